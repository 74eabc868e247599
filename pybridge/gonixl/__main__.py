"""python -m gonixl: print the library version and what it finds here."""

import json
import sys

from . import _lib, errors, probe


def main() -> int:
    try:
        info = probe()
    except errors.GoNixlError as e:
        print(f"gonixl: {e}", file=sys.stderr)
        return 1
    info["library_path"] = _lib.library_path()
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
