#!/usr/bin/env python3
"""The NIXL-Python side of `gonixl-bench transfer`.

Runs the same transfers as the Go benchmark through NIXL's own Python API
(nixl._api.nixl_agent, or nixl_cuXX._api to match the flavour Go loaded):
two processes (this one initiates; the target is this script again with
--target-only, the same target program gonixl's initiator reads from), one
region of --cap bytes per side, for every (op, block size, batch size) the
same index arrays as the Go side, and per iteration the steps vLLM's
NixlConnector takes: make_prepped_xfer (with a notification), transfer,
check_xfer_state until DONE, release_xfer_handle. Prints one JSON object
per line; the Go command joins them with its own results.

With --serve it measures the sizes requested on stdin instead (one JSON
object a line, {"op": "read", "block": N, "batch": M}; "quit" ends), which
lets gonixl-bench alternate gonixl and NIXL-Python size by size.

Usage (normally started by gonixl-bench):
  nixl_python_bench.py --module nixl_cu12 --ops read,write \
      --block-sizes 4096,65536 --batch-sizes 1,256 --cap 268435456 \
      --max-batch-bytes 1073741824 --min-time 0.2 --min-iters 3 --max-iters 1000 \
      --pattern scattered --progress-thread 1
"""

import argparse
import importlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

PRIME = 7919  # index stride for the scattered pattern; must match transfer.go


def indices(pattern, batch, slots, side):
    """Descriptor indices, identical to transfer.go's benchIndices."""
    i = np.arange(batch, dtype=np.int64)
    if pattern == "contiguous":
        return (i % slots).astype(np.int32)
    if pattern == "same":
        return np.full(batch, min(1, slots - 1), dtype=np.int32)
    off = 0 if side == "local" else 1
    return ((i * PRIME + off) % slots).astype(np.int32)


def set_thp(on):
    """Choose whether numpy advises transparent huge pages for large arrays
    (numpy's default is to advise them; torch's CPU allocator does not), so
    that both implementations register the same kind of memory."""
    core = getattr(np, "_core", None) or np.core
    core.multiarray._set_madvise_hugepage(bool(on))


def load_api(module):
    return importlib.import_module(module + "._api")


def make_target(module, cap, progress, thp):
    """A target agent with one registered region of cap bytes (np.ones)."""
    set_thp(thp)
    api = load_api(module)
    cfg = api.nixl_agent_config(enable_prog_thread=progress, backends=["UCX"])
    agent = api.nixl_agent("py-bench-target-%d" % os.getpid(), cfg)
    buf = np.ones(cap, dtype=np.uint8)
    reg = agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
    return agent, buf, reg


def target_stdio(args):
    """--target-only: the target process, for this script's own initiator
    and for gonixl's (gonixl-bench transfer -target python), so that both
    read from and write into the very same program: one JSON line
    {"md": hex, "base": address} on stdout, then notifications drained every
    millisecond until stdin closes."""
    agent, buf, reg = make_target(args.module, args.cap, bool(args.progress_thread), bool(args.thp))
    print(json.dumps({"md": agent.get_agent_metadata().hex(), "base": buf.ctypes.data}), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    while not done.wait(0.001):
        agent.get_new_notifs()
    agent.deregister_memory(reg)


def measure(agent, args, lists, remote, remote_base, buf, op, bs, batch):
    """One (op, block, batch) measurement: iterations of make, transfer,
    poll, release, as in transfer.go's sweep."""
    if bs not in lists:
        slots = max(1, args.cap // bs)
        ldescs = np.array([[buf.ctypes.data + s * bs, bs, 0] for s in range(slots)], dtype=np.uint64)
        rdescs = np.array([[remote_base + s * bs, bs, 0] for s in range(slots)], dtype=np.uint64)
        lists[bs] = (slots, agent.prep_xfer_dlist("", agent.get_xfer_descs(ldescs, "DRAM")),
                     agent.prep_xfer_dlist(remote, agent.get_xfer_descs(rdescs, "DRAM")))
    slots, lh, rh = lists[bs]
    li = indices(args.pattern, batch, slots, "local")
    ri = indices(args.pattern, batch, slots, "remote")
    opname = op.upper()
    makes, posts, xfers, rels = [], [], [], []
    start = time.perf_counter()
    it = 0
    while it < args.max_iters and (it < args.min_iters or time.perf_counter() - start < args.min_time):
        t0 = time.perf_counter_ns()
        h = agent.make_prepped_xfer(opname, lh, li, rh, ri, b"bench:%d" % it)
        t1 = time.perf_counter_ns()
        st = agent.transfer(h)
        t2 = time.perf_counter_ns()
        while st == "PROC":
            st = agent.check_xfer_state(h)
        t3 = time.perf_counter_ns()
        if st != "DONE":
            raise RuntimeError("transfer ended in %s" % st)
        agent.release_xfer_handle(h)
        t4 = time.perf_counter_ns()
        makes.append(t1 - t0)
        posts.append(t2 - t1)
        xfers.append(t3 - t1)
        rels.append(t4 - t3)
        it += 1
    return {"op": op, "block": bs, "batch": batch, "iters": it,
            "make_ns": makes, "post_ns": posts, "xfer_ns": xfers, "release_ns": rels}


def start_target(args):
    """Start this script with --target-only (the program gonixl's initiator
    starts too) and return the process, its metadata and region address."""
    cmd = [sys.executable, os.path.abspath(__file__), "--target-only", "--module", args.module,
           "--cap", str(args.cap), "--progress-thread", str(args.progress_thread), "--thp", str(args.thp)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    for line in proc.stdout:
        try:
            hello = json.loads(line)
        except ValueError:
            continue  # not ours (a library printing to stdout)
        if isinstance(hello, dict) and "md" in hello:
            # The rest of its stdout is logs: keep the pipe drained.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, bytes.fromhex(hello["md"]), int(hello["base"])
    proc.wait(30)
    raise RuntimeError("target exited before it was ready (status %s)" % proc.returncode)


def run(args):
    api = load_api(args.module)
    proc, md, remote_base = start_target(args)
    try:
        cfg = api.nixl_agent_config(enable_prog_thread=bool(args.progress_thread), backends=["UCX"],
                                    capture_telemetry=True)
        agent = api.nixl_agent("py-bench-init-%d" % os.getpid(), cfg)
        set_thp(args.thp)
        buf = np.zeros(args.cap, dtype=np.uint8)
        reg = agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"))
        remote = agent.add_remote_agent(md)
        lists = {}
        print(json.dumps({"info": {"module": args.module, "api_file": api.__file__}}), flush=True)
        if args.serve:
            # One request per line on stdin: {"op": "read", "block": N, "batch": M}.
            for line in sys.stdin:
                line = line.strip()
                if not line or line == "quit":
                    break
                req = json.loads(line)
                print(json.dumps(measure(agent, args, lists, remote, remote_base, buf,
                                         req["op"], int(req["block"]), int(req["batch"]))), flush=True)
        else:
            for op in args.ops.split(","):
                for bs in [int(x) for x in args.block_sizes.split(",")]:
                    for batch in [int(x) for x in args.batch_sizes.split(",")]:
                        if bs * batch <= args.max_batch_bytes:
                            print(json.dumps(measure(agent, args, lists, remote, remote_base, buf, op, bs, batch)),
                                  flush=True)
        for _, lh, rh in lists.values():
            agent.release_dlist_handle(lh)
            agent.release_dlist_handle(rh)
        agent.deregister_memory(reg)
        agent.remove_remote_agent(remote)
    finally:
        proc.stdin.close()  # the target deregisters and exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", default="nixl", help="package whose _api to use: nixl, nixl_cu12 or nixl_cu13")
    p.add_argument("--ops", default="read,write")
    p.add_argument("--block-sizes", default="4096,65536,1048576")
    p.add_argument("--batch-sizes", default="1,256,4096")
    p.add_argument("--cap", type=int, default=256 << 20)
    p.add_argument("--max-batch-bytes", type=int, default=1 << 30)
    p.add_argument("--min-time", type=float, default=0.2)
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--pattern", choices=["scattered", "contiguous", "same"], default="scattered")
    p.add_argument("--progress-thread", type=int, default=1)
    p.add_argument("--thp", type=int, default=0,
                   help="1: advise transparent huge pages for the buffers (numpy's default); 0: not (torch's)")
    p.add_argument("--serve", action="store_true",
                   help="measure the sizes requested on stdin, one JSON object a line, instead of the lists")
    p.add_argument("--target-only", action="store_true",
                   help="only run a target for another initiator (see target_stdio)")
    args = p.parse_args()
    if args.target_only:
        target_stdio(args)
    else:
        run(args)
    # Leave without interpreter finalisation: tearing the nixl_agent down at
    # exit has crashed (SIGSEGV) on this host after all results were out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
