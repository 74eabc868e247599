#!/usr/bin/env python3
"""The gather kernel alone (nixl/ucx/cuda/gather.cu), in one process: how
close to a plain device copy it moves a request's scattered blocks, for a
few unroll depths, block sizes per thread block and grid sizes. Used to
choose the shipped kernel's parameters; the kernel source is the one the
library embeds (compiled here with cupy's NVRTC and -DGX_UNROLL=N).

    python3 tests/gpu/gather_variants.py [--blocks 8192] [--read 2048] [--layers 28]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import cupy as cp
import numpy as np

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "nixl", "ucx", "cuda", "gather.cu")


def timed(fn, reps: int = 10) -> float:
    fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8192)
    ap.add_argument("--read", type=int, nargs="+", default=[2048, 8000])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--block-bytes", type=int, default=32768)
    ap.add_argument("--out")
    a = ap.parse_args()
    nreg, blk = 2 * a.layers, a.block_bytes
    region = a.blocks * blk
    src = cp.cuda.alloc(nreg * region)
    dst = cp.cuda.alloc(nreg * region)
    cp.cuda.runtime.memsetAsync(src.ptr, 1, nreg * region, 0)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    with open(SRC) as f:
        code = f.read()
    results = {"sms": sms, "rows": []}
    for n in a.read:
        rng = np.random.default_rng(7)
        rb = rng.choice(np.arange(1, a.blocks), n, replace=False).astype(np.uint32)
        lb = rng.choice(np.arange(1, a.blocks), n, replace=False).astype(np.uint32)
        regs = np.zeros((nreg, 5), dtype=np.uint64)
        for r in range(nreg):
            regs[r] = (src.ptr + r * region, dst.ptr + r * region, blk, blk, blk)
        pairs = np.stack([rb, lb], axis=1).astype(np.uint32)
        d_regs, d_pairs = cp.asarray(regs), cp.asarray(pairs)
        nbytes = n * nreg * blk
        # The same bytes as large contiguous copies (per region): the peak.
        per = n * blk

        def peak():
            for r in range(nreg):
                cp.cuda.runtime.memcpyAsync(dst.ptr + r * region, src.ptr + r * region, per, 3, 0)

        t_peak = timed(peak)
        results["rows"].append({"read": n, "variant": "memcpy per region (peak)", "s": t_peak, "GBps": nbytes / t_peak / 1e9})
        print(f"{n} blocks: peak (one memcpy per region) {nbytes / t_peak / 1e9:.0f} GB/s", flush=True)
        chunk = 65536
        nchunks = (blk + chunk - 1) // chunk
        items = nreg * n * nchunks
        for unroll in (4, 8, 16):
            for threads in (256, 512):
                if unroll == 16 and threads == 512:
                    continue
                mod = cp.RawModule(code=code, options=(f"-DGX_UNROLL={unroll}", f"-DGX_THREADS={threads}", "--std=c++17"))
                fn = mod.get_function("gx_gather_blocks")
                for waves in (4, 8, 16, 32):
                    grid = min(items, sms * waves)

                    def run(fn=fn, grid=grid, threads=threads):
                        fn(
                            (grid,),
                            (threads,),
                            (
                                d_regs,
                                np.uint64(nreg),
                                d_pairs,
                                np.uint64(n),
                                np.uint64(chunk),
                                np.uint64(nchunks),
                            ),
                        )

                    t = timed(run)
                    row = {"read": n, "variant": f"unroll {unroll}, {threads} threads, grid {waves}x SMs", "s": t, "GBps": nbytes / t / 1e9,
                           "of_peak": t_peak / t}
                    results["rows"].append(row)
                    print(f"  {row['variant']}: {row['GBps']:.0f} GB/s = {row['of_peak']:.2f} of peak", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
