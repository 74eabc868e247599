"""What a call into libgonixl costs after the library went idle.

    .venv/bin/python bench/cold_call.py [--calls N] [--gap-ms MS] [--lib PATH]

vLLM calls into the library a few times per engine step, with Python work
between the calls; by then the Go runtime has gone idle. This measures,
with --gap-ms of sleep before each call:

- a trivial call (gonixl.abi_version): the crossing alone;
- a decode scheduler's get_num_new_matched_tokens on fresh 951-byte params
  (a parse-cache miss: what vLLM's first call about a request costs), and
  the same call again at once (a hit);
- the process's CPU time over the loop, all threads, as a share of wall
  time (the Go runtime's own threads included).

Medians in microseconds. To see what the runtime's sysmon wake costs, run
it again with GODEBUG=schedtrace=10000000 in the environment (sysmon then
never enters the deep sleep a call must wake it from; docs/BENCHMARKS.md,
"A call after the library went idle"). --lib picks the library
(GONIXL_LIB_PATH) for A/B runs. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time


def _params(i: int) -> bytes:
    return json.dumps(
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(100 + i, 132 + i))],
            "remote_engine_id": "p",
            "remote_request_id": f"r{i}",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": 1000,
            "remote_blocks_expiry_time": 123.5,
            "gonixl_instance": "abc",
            "transfer_mode": "pull",
            "gonixl_kv_digest": {
                "alg": "xxh3-64",
                "tokens": 1000,
                "first": [0],
                "ranks": [{"blocks": ["A" * 344], "regions": ["B" * 24]}],
            },
        }
    ).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _us(v: list[float]) -> float:
    return statistics.median(v) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=600)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--lib", default="")
    a = ap.parse_args()
    if a.lib:
        os.environ["GONIXL_LIB_PATH"] = os.path.abspath(a.lib)
    import gonixl
    import gonixl._lib
    from gonixl.engine import Scheduler

    gap = a.gap_ms / 1000
    gonixl.abi_version()  # loads the library
    time.sleep(0.05)

    trivial: list[float] = []
    t0, w0 = os.times(), time.perf_counter()
    for _ in range(a.calls):
        time.sleep(gap)
        t = time.perf_counter()
        gonixl.abi_version()
        trivial.append(time.perf_counter() - t)
    t1, w1 = os.times(), time.perf_counter()
    cpu = ((t1.user + t1.system) - (t0.user + t0.system)) / (w1 - w0) * 100

    cfg = {
        "kv_role": "kv_consumer",
        "engine_id": "cold-call",
        "side_channel_host": "127.0.0.1",
        "side_channel_port": _free_port(),
        "block_size": 32,
        "kv_connector_extra_config": {},
        "compat_factors": {"model": "m"},
    }
    s = Scheduler(cfg)
    miss: list[float] = []
    hit: list[float] = []
    size = 0
    try:
        for i in range(a.calls):
            pj = _params(i)
            size = len(pj)
            time.sleep(gap)
            t = time.perf_counter()
            s.get_num_new_matched_tokens(pj, 1000, 0)
            miss.append(time.perf_counter() - t)
            t = time.perf_counter()
            s.get_num_new_matched_tokens(pj, 1000, 0)
            hit.append(time.perf_counter() - t)
    finally:
        s.close()
    skip = min(50, a.calls // 10)  # the first calls warm the caches
    print(f"library {gonixl._lib.library_path()}")
    print(
        f"GODEBUG={os.environ.get('GODEBUG', '')!r}, {a.calls} calls, {a.gap_ms:g} ms before each"
    )
    print(
        f"trivial call p50 {_us(trivial[skip:]):.1f} us; process CPU {cpu:.1f}% of wall over that loop"
    )
    print(
        f"get_num_new_matched_tokens ({size}-byte params) miss p50 {_us(miss[skip:]):.1f} us, hit p50 {_us(hit[skip:]):.1f} us"
    )


if __name__ == "__main__":
    main()
