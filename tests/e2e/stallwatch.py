"""Machine stall watcher for ./build.sh test.

    python stallwatch.py STALLS_FILE [INSTANCES_FILE]

Sleeps 0.5 s at a time and writes a line to STALLS_FILE each time it woke
more than STALL_S late: a process of the machine that got no CPU for that
long. vLLM's engines on a loaded 2-vCPU VM stall the same way, and a
request that fails by a timeout or an expired lease during such a stall is
the machine's, not the connector's. At exit ./build.sh prints the lines, and
the kernel's own lockup reports of the same time (dmesg, where readable),
after the test's output.

With INSTANCES_FILE it also counts the vLLM instances alive (processes
running vLLM's OpenAI API server, `python -m vllm.entrypoints.openai.api_server`
or `vllm serve`: one per instance, whatever its TP or DP size) and appends "<unix time> <count>" each time the count changes;
tests/testreport.py reports the most alive during each step. Pure standard
library.
"""

from __future__ import annotations

import os
import sys
import time

STALL_S = 5.0


API_SERVER = b"vllm.entrypoints.openai.api_server"


def vllm_instances() -> int:
    """API-server processes whose parent is not one: a process the server
    forks (its engine core, before it renames itself) has its command line
    for a moment and is not another instance."""
    servers: dict[str, str] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            # python -m vllm.entrypoints.openai.api_server ..., or vllm serve ...
            # (through its script's shebang: python .../bin/vllm serve ...)
            serve = any(a.endswith(b"vllm") and b == b"serve" for a, b in zip(argv, argv[1:]))
            if not serve and API_SERVER not in b"\0".join(argv):
                continue
            with open(f"/proc/{pid}/stat") as f:
                servers[pid] = f.read().rsplit(")", 1)[1].split()[1]  # the parent's pid
        except (OSError, IndexError):
            pass
    return sum(1 for ppid in servers.values() if ppid not in servers)


def main() -> None:
    path = sys.argv[1]
    instances = sys.argv[2] if len(sys.argv) > 2 else ""
    count = -1
    last = time.monotonic()
    while True:
        time.sleep(0.5)
        if instances:
            c = vllm_instances()
            if c != count:
                count = c
                with open(instances, "a") as f:
                    f.write(f"{time.time():.1f} {c}\n")
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
