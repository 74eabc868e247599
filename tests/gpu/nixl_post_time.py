#!/usr/bin/env python3
"""Post time of a scattered KV-cache READ through NIXL's own Python API.

The baseline for gonixl's post path. The GPU data-path issue asks for "the
post time for 2,048 and 65,536 blocks, against NIXL's own Python API posting
the same descriptors"; gonixl's side is in docs/BENCHMARKS.md ("Post time").
This script produces the NIXL side, driving nixl._api.nixl_agent exactly the
way vLLM's NixlConnector (v1/nixl_connector.py, vLLM 0.32) does:

  KV cache   L layers, each one tensor [2, num_blocks, block_bytes] (K and V),
             registered as 2*L regions of num_blocks*block_bytes bytes
             (register_memory with one (addr, len, dev, "") tuple per region,
             as register_kv_caches does with split K and V).
  first      once per side, a descriptor list of every (region, block):
  contact    a Python list of (addr, block_bytes, dev) tuples, region-major
             (descriptor id = region * num_blocks + block),
             get_xfer_descs(list, "DRAM") and
               prep_xfer_dlist("NIXL_INIT_AGENT", descs)   the local list
               prep_xfer_dlist(remote_agent_name, descs)   the remote list
             (register_kv_caches / add_remote_agent). Timed per step.
  per        from the request's block ids (Python lists, as in the step
  request    metadata) vLLM's _get_block_descs_ids for each side:
               (np.arange(2L)[:, None] * num_blocks
                + np.array(block_ids)[None, :]).flatten()
             then
               h = make_prepped_xfer("READ", local_handle, local_ids,
                                     remote_handle, remote_ids, notif)
               transfer(h)
             (_read_blocks). These three, each timed, are the post: what
             vLLM's model thread pays in start_load_kv. Then, off the clock
             of the post, check_xfer_state(h) until DONE (60 s deadline),
             get_xfer_telemetry(h) (NIXL's own postDuration / descCount) and
             release_xfer_handle(h), as _pop_done_transfers does.

Each request size in --read is one scattered set of distinct blocks in random
order (so NIXL's merging of adjacent descriptors finds nothing to merge: the
telemetry's descCount equals 2 * layers * blocks), a different set on each
side; the median over --rounds rounds is printed, in microseconds, and --out
keeps every round. Blocks are small (--block-bytes, default 512, the size of
docs/BENCHMARKS.md's post-time run: 1 head x 16 dims x 16 tokens x bf16): the
post cost depends on the descriptor count, not on the bytes. After the first
round of each size the destination blocks are compared with the source's
pattern.

Agents: two in this one process, "A" (the reader, vLLM's decode side,
nixl_agent_config(num_threads=--num-threads, capture_telemetry=True), progress
thread on, as vLLM 0.32 configures it: num_threads 4 by default) and "B" (the
target, prefill side), backend UCX, DRAM from torch CPU tensors. B's metadata
goes into A with A.add_remote_agent(B.get_agent_metadata()). A DRAM READ
between two agents of one process works with the installed NIXL (1.5.1, UCX
1.23.0 from the wheel) and is checked byte for byte here, so no second
process is needed. UCX picks cma (process_vm_readv, zero-copy) for the READ
and tcp/lo for active messages (the notification).

What the numbers mean, and caveats (this host: 2 shared vCPUs, no GPU):
- transfer() with num_threads 4 hands the descriptors to NIXL's UCX worker
  threads and returns "PROC"; the copies happen there ("complete" is the
  time until check_xfer_state says DONE). With --num-threads 0 transfer()
  itself performs every CMA read (a few us per descriptor), so "transfer" then
  includes the copy. On a GPU host the transport differs (cuda_ipc, RDMA);
  ids + make_prepped_xfer and transfer()'s hand-off are NIXL's own cost.
- The target must make progress: with B's progress thread off and nothing
  polling B, no READ completed within 60 s. NIXL's Python API starts a
  progress thread with a delay of 0, which never sleeps and takes a whole
  core (docs/environment-nixl.md, item 6), so by default B is progressed the
  way a prefill worker's get_finished does it, by a Python thread calling
  B.get_new_notifs() every --poll-ms (--target-progress thread: NIXL's
  thread instead). A's progress thread stays on, as in vLLM.
- The first round of the first size includes UCX's connection set-up, and
  the first round of a larger size the growth of the process by the memory
  below (seconds in transfer() for 65,536 blocks); the medians leave them
  aside, --out has every round. The ids step of a 65,536-block request
  allocates two 29 MB arrays, and on this VM their first touch made it vary
  from 10 ms to 0.4 s between rounds; timings here are noisy in general
  (shared vCPUs), so compare medians of runs on a quiet host.
- Memory: the caches are 2 * 2 * layers * blocks * block_bytes (3.5 GiB with
  the defaults), but the peak RSS is about twice that: NIXL/UCX hold about
  1.1 KB per descriptor of an in-flight READ (~100 B after make_prepped_xfer,
  the rest after transfer(), with num_threads 4), about 4 GB for the
  3,670,016-descriptor request, and the allocator keeps it after release.
  --block-bytes 64 shrinks the caches to 0.44 GiB with the same descriptor
  counts. --out records RSS at each stage.
- Tearing the agents down at interpreter exit crashes (SIGSEGV in the bundled
  libnl-route's destructor, rtnl_tc_unregister, even for one idle agent), so
  the script leaves with os._exit once its results are out (as
  bench/nixl_python_bench.py does).

    .venv/bin/python tests/gpu/nixl_post_time.py
    .venv/bin/python tests/gpu/nixl_post_time.py --layers 2 --blocks 1024 --read 64 512 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import threading
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28, help="attention layers (2 regions each, K and V)")
    p.add_argument("--blocks", type=int, default=65600, help="num_blocks per region (both sides)")
    p.add_argument("--block-bytes", type=int, default=512, help="bytes of one block of one region")
    p.add_argument("--read", type=int, nargs="+", default=[2048, 65536], help="request sizes in blocks")
    p.add_argument("--rounds", type=int, default=5, help="rounds per request size (median reported)")
    p.add_argument("--num-threads", type=int, default=4,
                   help="nixl_agent_config num_threads for the reader (vLLM's default is 4)")
    p.add_argument("--target-progress", choices=["poll", "thread"], default="poll",
                   help="how the target agent B progresses: poll (a Python thread calling "
                        "get_new_notifs every --poll-ms, as a prefill worker's get_finished does) "
                        "or thread (NIXL's progress thread)")
    p.add_argument("--poll-ms", type=float, default=1.0)
    p.add_argument("--reader-progress-thread", type=int, choices=[0, 1], default=1,
                   help="0: no NIXL progress thread in the reader A (vLLM runs it)")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds to wait for one READ to complete")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-verify", action="store_true", help="skip the byte check after the first round")
    p.add_argument("--out", help="write the results as JSON to this file")
    a = p.parse_args()
    if a.block_bytes <= 0 or a.block_bytes % 4:
        p.error("--block-bytes must be a positive multiple of 4")
    if any(n <= 0 or n > a.blocks for n in a.read):
        p.error("every --read size must be in 1..--blocks")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    return a


def rss_mib() -> dict:
    """This process's resident memory now and at its peak, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith(("VmRSS:", "VmHWM:")):
                out[ln.split(":")[0]] = int(ln.split()[1]) // 1024
    return {"rss_mib": out.get("VmRSS"), "peak_mib": out.get("VmHWM")}


def us(ns: float) -> float:
    return ns / 1e3


def versions() -> dict:
    """NIXL's package versions, the backend module it loaded, and UCX's
    version from the libucp this process mapped."""
    v = {"python": platform.python_version()}
    for dist in ("nixl", "nixl-cu12", "nixl-cu13", "torch", "numpy"):
        try:
            v[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    api = sys.modules.get("nixl._api")
    v["nixl_api_file"] = getattr(api, "__file__", None)
    try:
        import ctypes

        with open("/proc/self/maps") as f:
            libucp = next((ln.split()[-1] for ln in f if "libucp" in ln and ln.split()[-1].startswith("/")), None)
        if libucp:
            fn = ctypes.CDLL(libucp).ucp_get_version_string
            fn.restype = ctypes.c_char_p
            v["ucx"] = fn().decode()
            v["libucp"] = libucp
    except Exception as e:  # noqa: BLE001 -- informational only
        v["ucx"] = f"unknown ({e})"
    return v


class KVCache:
    """One side's cache: per layer a [2, num_blocks, block_bytes] uint8
    tensor; regions are K0, V0, K1, V1, ... as vLLM registers them."""

    def __init__(self, a, fill: bool):
        import torch

        self.layers = [torch.zeros((2, a.blocks, a.block_bytes), dtype=torch.uint8) for _ in range(a.layers)]
        self.regions = [t[kv] for t in self.layers for kv in (0, 1)]
        if fill:
            for r, reg in enumerate(self.regions):
                reg.view(torch.int32).copy_(self.pattern(r, a.blocks, torch.arange(a.blocks))[:, None])

    @staticmethod
    def pattern(region: int, num_blocks: int, blocks):
        """Every 4-byte word of block b of region r holds r * num_blocks + b."""
        import torch

        return (region * num_blocks + blocks).to(dtype=torch.int32)

    def reg_tuples(self) -> list[tuple[int, int, int, str]]:
        # register_kv_caches: (base_addr, region bytes, device id, "").
        return [(r.data_ptr(), r.numel() * r.element_size(), 0, "") for r in self.regions]

    def block_tuples(self, num_blocks: int, block_len: int) -> list[tuple[int, int, int]]:
        # register_kv_caches / add_remote_agent: for each region, for each block.
        data = []
        for r in self.regions:
            base = r.data_ptr()
            for block_id in range(num_blocks):
                data.append((base + block_id * block_len, block_len, 0))
        return data


def block_descs_ids(num_regions: int, num_blocks: int, block_ids: list[int]):
    """vLLM's NixlConnectorWorker._get_block_descs_ids (all regions)."""
    import numpy as np

    region_ids = np.arange(num_regions)[:, None]
    block_ids = np.array(block_ids)[None, :]
    return (region_ids * num_blocks + block_ids).flatten()


def timed(fn, *args):
    t0 = time.perf_counter_ns()
    out = fn(*args)
    return out, time.perf_counter_ns() - t0


def verify(a, src: KVCache, dst: KVCache, local_ids: list[int], remote_ids: list[int]) -> int:
    """Count the (region, block) pairs of the request whose destination
    differs from the source's pattern."""
    import torch

    li = torch.tensor(local_ids)
    want_blocks = torch.tensor(remote_ids)
    bad = 0
    for r, reg in enumerate(dst.regions):
        got = reg.view(torch.int32)[li]  # [n, words]
        want = KVCache.pattern(r, a.blocks, want_blocks)[:, None]
        bad += int((got != want).any(dim=1).sum())
    return bad


def main() -> int:
    a = parse_args()
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    torch.set_num_threads(1)
    rng = np.random.default_rng(a.seed)
    num_regions = 2 * a.layers
    list_descs = num_regions * a.blocks
    gib = 2 * num_regions * a.blocks * a.block_bytes / 2**30
    print(f"# layers={a.layers} regions={num_regions} num_blocks={a.blocks} block_bytes={a.block_bytes} "
          f"descs/list={list_descs:,} memory={gib:.2f} GiB (both sides) rounds={a.rounds}", flush=True)

    t_setup = time.perf_counter()
    # vLLM 0.32, UCX only: nixl_agent_config(num_threads=4, capture_telemetry=True); progress thread on.
    A = nixl_agent("A", nixl_agent_config(backends=["UCX"], num_threads=a.num_threads, capture_telemetry=True,
                                          enable_prog_thread=bool(a.reader_progress_thread)))
    B = nixl_agent("B", nixl_agent_config(backends=["UCX"], enable_prog_thread=a.target_progress == "thread"))
    stop = threading.Event()
    b_notifs: list[bytes] = []
    if a.target_progress == "poll":
        def poll_target():
            while not stop.wait(a.poll_ms / 1e3):
                for msgs in B.get_new_notifs().values():
                    b_notifs.extend(msgs)
        poller = threading.Thread(target=poll_target, name="target-poll", daemon=True)
        poller.start()
    info = versions()

    src = KVCache(a, fill=True)   # B: prefill side, holds the pattern
    dst = KVCache(a, fill=False)  # A: decode side, reads into zeros
    first: dict[str, float] = {}
    (regB, first["register_remote_us"]) = timed(B.register_memory, B.get_reg_descs(src.reg_tuples(), "DRAM"))
    (regA, first["register_local_us"]) = timed(A.register_memory, A.get_reg_descs(dst.reg_tuples(), "DRAM"))
    first = {k: us(v) for k, v in first.items()}
    mem = {"caches_registered": rss_mib()}

    # First contact, local side (register_kv_caches).
    t0 = time.perf_counter_ns()
    blocks_data = dst.block_tuples(a.blocks, a.block_bytes)
    t1 = time.perf_counter_ns()
    descs = A.get_xfer_descs(blocks_data, "DRAM")
    t2 = time.perf_counter_ns()
    local_h = A.prep_xfer_dlist("NIXL_INIT_AGENT", descs)
    t3 = time.perf_counter_ns()
    first.update(local_build_us=us(t1 - t0), local_get_xfer_descs_us=us(t2 - t1), local_prep_us=us(t3 - t2))
    del blocks_data, descs
    gc.collect()

    # First contact, remote side (add_remote_agent): metadata, then the remote list.
    md = B.get_agent_metadata()
    t0 = time.perf_counter_ns()
    remote_name = A.add_remote_agent(md)
    t1 = time.perf_counter_ns()
    blocks_data = src.block_tuples(a.blocks, a.block_bytes)  # the addresses B advertises
    t2 = time.perf_counter_ns()
    descs = A.get_xfer_descs(blocks_data, "DRAM")
    t3 = time.perf_counter_ns()
    remote_h = A.prep_xfer_dlist(remote_name, descs)
    t4 = time.perf_counter_ns()
    first.update(add_remote_agent_us=us(t1 - t0), remote_build_us=us(t2 - t1),
                 remote_get_xfer_descs_us=us(t3 - t2), remote_prep_us=us(t4 - t3), metadata_bytes=len(md))
    del blocks_data, descs
    gc.collect()
    mem["first_contact_done"] = rss_mib()
    print(f"first contact: prep_xfer_dlist local {first['local_prep_us']:,.0f} us, "
          f"remote {first['remote_prep_us']:,.0f} us ({list_descs:,} descs each); "
          f"building the tuple lists {first['local_build_us'] + first['remote_build_us']:,.0f} us, "
          f"get_xfer_descs {first['local_get_xfer_descs_us'] + first['remote_get_xfer_descs_us']:,.0f} us, "
          f"add_remote_agent {first['add_remote_agent_us']:,.0f} us", flush=True)

    results = []
    ok = True
    req = 0
    for n in a.read:
        # A scattered set of distinct blocks in random order, different per side.
        local_blocks = rng.choice(a.blocks, size=n, replace=False).tolist()
        remote_blocks = rng.choice(a.blocks, size=n, replace=False).tolist()
        for reg in dst.regions:  # the destination starts at zero for the check
            reg[torch.tensor(local_blocks)] = 0
        rounds = []
        bad = None
        for rnd in range(a.rounds):
            gc.collect()
            req += 1
            notif = f"req-{req}:1".encode()  # vLLM: f"{request_id}:{tp_ratio}"
            t0 = time.perf_counter_ns()
            remote_ids = block_descs_ids(num_regions, a.blocks, remote_blocks)
            local_ids = block_descs_ids(num_regions, a.blocks, local_blocks)
            t1 = time.perf_counter_ns()
            h = A.make_prepped_xfer("READ", local_h, local_ids, remote_h, remote_ids, notif_msg=notif)
            t2 = time.perf_counter_ns()
            made = rss_mib()["rss_mib"]  # off the clock: between the two timed calls
            t2b = time.perf_counter_ns()
            posted = A.transfer(h)
            t3 = time.perf_counter_ns()
            state = posted
            deadline = time.monotonic() + a.deadline
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0001)
                state = A.check_xfer_state(h)
            t4 = time.perf_counter_ns()
            in_flight = rss_mib()["rss_mib"]  # the handle still held
            if state != "DONE":
                print(f"READ of {n} blocks, round {rnd}: state {state} after {us(t4 - t3) / 1e6:.1f} s",
                      file=sys.stderr, flush=True)
                ok = False
            tel = A.get_xfer_telemetry(h) if state == "DONE" else None
            t5 = time.perf_counter_ns()
            A.release_xfer_handle(h)
            t6 = time.perf_counter_ns()
            if state != "DONE":
                break
            rounds.append({
                "ids_us": us(t1 - t0), "make_us": us(t2 - t1), "transfer_us": us(t3 - t2b),
                "post_us": us((t1 - t0) + (t2 - t1) + (t3 - t2b)), "transfer_returned": posted,
                "complete_us": us(t4 - t3), "release_us": us(t6 - t5),
                "nixl_post_duration_us": tel.postDuration, "nixl_xfer_duration_us": tel.xferDuration,
                "nixl_desc_count": tel.descCount, "nixl_total_bytes": tel.totalBytes,
                "rss_after_make_mib": made, "rss_after_complete_mib": in_flight,
            })
            if rnd == 0 and not a.no_verify:
                bad = verify(a, src, dst, local_blocks, remote_blocks)
                if bad:
                    print(f"READ of {n} blocks: {bad} (region, block) pairs differ from the source",
                          file=sys.stderr, flush=True)
                    ok = False
        if a.target_progress == "thread":  # else the poller has been draining them
            for msgs in B.get_new_notifs().values():
                b_notifs.extend(msgs)
        notifs = len(b_notifs)
        if not rounds:
            results.append({"blocks": n, "error": "READ did not complete"})
            continue
        med = {k: statistics.median(r[k] for r in rounds)
               for k in ("ids_us", "make_us", "transfer_us", "post_us", "complete_us", "release_us",
                         "nixl_post_duration_us", "nixl_xfer_duration_us")}
        descs = num_regions * n
        results.append({"blocks": n, "descriptors": descs, "median": med, "rounds": rounds,
                        "bad_blocks": bad, "target_notifications_so_far": notifs, "memory": rss_mib()})
        returned = "/".join(sorted({r["transfer_returned"] for r in rounds}))
        print(f"read {n:>6} blocks  {descs:>9,} descs  post {med['post_us']:>10,.0f} us "
              f"(ids {med['ids_us']:,.0f} + make_prepped_xfer {med['make_us']:,.0f} + "
              f"transfer {med['transfer_us']:,.0f} -> {returned}; round 1 post {rounds[0]['post_us']:,.0f})  | complete {med['complete_us'] / 1e3:,.1f} ms, "
              f"release {med['release_us']:,.0f} us, NIXL postDuration {med['nixl_post_duration_us']:,.0f} us, "
              f"descCount {rounds[0]['nixl_desc_count']:,}  (median of {len(rounds)}"
              f"{'' if a.no_verify else ', bytes checked' if not bad else ', BYTES DIFFER'})", flush=True)

    stop.set()
    if a.target_progress == "poll":
        poller.join()
    A.release_dlist_handle(local_h)
    A.release_dlist_handle(remote_h)
    A.remove_remote_agent(remote_name)
    A.deregister_memory(regA)
    B.deregister_memory(regB)
    total_s = time.perf_counter() - t_setup

    out = {
        "what": "NIXL Python API post time for a scattered KV-cache READ, as vLLM's NixlConnector posts it",
        "config": {k: getattr(a, k) for k in ("layers", "blocks", "block_bytes", "read", "rounds", "num_threads",
                                              "target_progress", "poll_ms", "reader_progress_thread", "seed")}
        | {"regions": num_regions, "descs_per_list": list_descs, "mem_type": "DRAM", "backend": "UCX",
           "agents": "two in one process", "host": platform.node(), "cpus": os.cpu_count()},
        "versions": info,
        "first_contact": first,
        "memory": mem,
        "requests": results,
        "ok": ok,
        "total_s": total_s,
    }
    print(f"# NIXL {info.get('nixl')} ({os.path.basename(os.path.dirname(info.get('nixl_api_file') or ''))}), "
          f"UCX {info.get('ucx')}; {total_s:.1f} s; peak RSS {rss_mib()['peak_mib']:,} MiB "
          f"(caches registered {mem['caches_registered']['rss_mib']:,}, after first contact "
          f"{mem['first_contact_done']['rss_mib']:,}); {'ok' if ok else 'FAILED'}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as e:  # argparse: --help, usage errors
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:  # noqa: BLE001 -- report, then leave without finalisation
        import traceback

        traceback.print_exc()
        rc = 1
    # Leave without interpreter finalisation: the bundled libnl-route crashes
    # in its destructor at exit (see the docstring), after the results are out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
