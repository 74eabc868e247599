"""Machine stall watcher for ./build.sh test.

Sleeps 0.5 s at a time and writes a line to the file named by argv[1] each
time it woke more than STALL_S late: a process of the machine that got no
CPU for that long. vLLM's engines on a loaded 2-vCPU VM stall the same way,
and a request that fails by a timeout or an expired lease during such a
stall is the machine's, not the connector's. At exit ./build.sh prints the
lines, and the kernel's own lockup reports of the same time (dmesg, where
readable), after the test's output. Pure standard library.
"""

from __future__ import annotations

import os
import sys
import time

STALL_S = 5.0


def main() -> None:
    path = sys.argv[1]
    last = time.monotonic()
    while True:
        time.sleep(0.5)
        now = time.monotonic()
        if now - last > STALL_S:
            with open(path, "a") as f:
                f.write(
                    f"{time.strftime('%H:%M:%S', time.gmtime(time.time() - (now - last)))} UTC: "
                    f"no CPU for {now - last - 0.5:.0f} s (load average then {os.getloadavg()[0]:.0f})\n"
                )
        last = now


if __name__ == "__main__":
    main()
