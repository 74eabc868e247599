#!/usr/bin/env python3
"""First contact on the stock NixlConnector: what a decode worker of vLLM's own
connector runs the first time it meets a prefill engine, on the registration
of gonixl's BenchmarkFirstContactPrepare (shim/tp_bench_test.go).

What runs (all of it vLLM's installed code, called on a worker object that is
built with object.__new__ and given the attributes register_kv_caches would
have set):

  first contact   NixlBaseConnectorWorker._nixl_handshake(host, port,
                  remote_tp, engine_id): per target rank a ZMQ query to the
                  prefill's side channel (answered by the stock listener,
                  NixlBaseConnectorScheduler._nixl_handshake_listener, in a
                  thread of this process), msgspec decode of
                  NixlHandshakePayload and NixlAgentMetadata, the
                  compatibility-hash and parallel-config checks, then
                  add_remote_agent: TransferTopology registration,
                  compute_tp_mapping, nixl_agent.add_remote_agent (loads the
                  peer's metadata), _validate_remote_agent_handshake,
                  _build_local_splits_from_plan + get_xfer_descs +
                  prep_xfer_dlist("NIXL_INIT_AGENT") per source rank when
                  P TP > D TP, _build_fa_remote + get_xfer_descs +
                  prep_xfer_dlist(remote agent).
  register time   register_local_xfer_handler(block_size): _build_fa_local +
                  get_xfer_descs + prep_xfer_dlist("NIXL_INIT_AGENT") (the
                  local src handle; run once at register_kv_caches, reported
                  apart, not part of first contact).

NIXL is real (pip nixl, UCX backend, DRAM): one agent for the decode worker
and one per prefill rank, each registering its cache as one region per layer
(as register_kv_caches registers one range per storage). The caches are
MAP_NORESERVE anonymous mappings of the full size (52 GB for an 8-head rank
at 10,000 blocks) that are never touched: registration and descriptor
preparation only read addresses.

Stand-ins: the registration state of the decode worker (the attributes
register_kv_caches would set: per-region base addresses, block lengths and
strides, block counts, names), the prefill's NixlAgentMetadata (built with the
same fields its register_kv_caches would fill), and the compatibility hash (a
fixed string on both sides, compared as the stock code compares it).

Layouts:
  kv-split   gonixl's benchmark geometry: per layer [2, blocks, heads, 16, 128]
             bfloat16, K and V each one region: 160 regions, 1.6M descriptors
             per remote rank at 10,000 blocks, 82k at 512.
  fa-packed  the installed vLLM's FlashAttention cache, [blocks, heads, 16,
             2*128]: K and V in one block, 80 regions (half the descriptors).

Each case runs in fresh subprocesses: one for time (1 warm-up, then --reps
first contacts, each on a fresh worker with the previous handles released and
the remote agents removed), one for the RSS high-water mark (VmHWM reset via
/proc/self/clear_refs, delta over VmRSS before), one for tracemalloc's peak.

Usage:
  .venv/bin/python bench/stock_first_contact.py [--json OUT] [--reps 5]
      [--cases NAME,...] [--layouts kv-split,fa-packed] [--gonixl]
--gonixl also runs gonixl's benchmarks afterwards (go test ./shim -bench
FirstContactPrepare and ./nixl/ucx -bench PrepDescList) and adds ratios.
"""

import argparse
import ctypes
import gc
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The cases of BenchmarkFirstContactPrepare: (name, local TP, remote TP, local rank, blocks).
CASES = [
    ("D2-from-P1/80L-10kblocks", 2, 1, 1, 10000),
    ("D1-from-P2/80L-10kblocks", 1, 2, 0, 10000),
    ("D2-from-P1/80L-512blocks", 2, 1, 1, 512),
    ("D1-from-P1/80L-512blocks", 1, 1, 0, 512),
]
LAYERS, KV_HEADS, BLOCK_SIZE, HEAD_DIM, ELEM = 80, 8, 16, 128, 2
ENGINE_D, ENGINE_P = "engine-d", "engine-p"
COMPAT = "stand-in-compat-hash"


# ---------------------------------------------------------------- memory


def _status(keys=("VmRSS", "VmHWM")):
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
PROT_RW, MAP_PRIVATE, MAP_ANON, MAP_NORESERVE = 3, 0x02, 0x20, 0x4000


def reserve(nbytes):
    """Address space for a cache that is registered but never touched."""
    p = _libc.mmap(None, nbytes, PROT_RW, MAP_PRIVATE | MAP_ANON | MAP_NORESERVE, -1, 0)
    if p is None or p == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap MAP_NORESERVE failed")
    return p


# ---------------------------------------------------------------- geometry


class Registration:
    """One rank's cache: regions (base, block_len, stride, blocks) and the
    per-layer storages that register_kv_caches would register."""

    def __init__(self, layout, heads, blocks, base):
        page = heads * BLOCK_SIZE * HEAD_DIM * ELEM  # one of K or V, one block
        per_layer = 2 * blocks * page  # the layer's storage, K and V
        self.storages, self.regions, self.names = [], [], []
        for layer in range(LAYERS):
            lb = base + layer * (per_layer + 4096)  # the Go benchmark's gap
            name = f"model.layers.{layer}.self_attn"
            self.storages.append((lb, per_layer))
            if layout == "kv-split":  # [2, blocks, heads, 16, 128]
                for kv in range(2):
                    self.regions.append((lb + kv * blocks * page, page, page, blocks))
                    self.names.append(name)
            else:  # fa-packed: [blocks, heads, 16, 2*128]
                self.regions.append((lb, 2 * page, 2 * page, blocks))
                self.names.append(name)
        self.span = LAYERS * (per_layer + 4096)


def span_for(heads, blocks):
    page = heads * BLOCK_SIZE * HEAD_DIM * ELEM
    return LAYERS * (2 * blocks * page + 4096)


# ---------------------------------------------------------------- the stock worker


class TimedAgent:
    """The real nixl_agent, with the time spent in the calls the connector
    makes at first contact summed per method."""

    TIMED = ("add_remote_agent", "get_xfer_descs", "prep_xfer_dlist")

    def __init__(self, agent):
        self._agent = agent
        self.spent = {}

    def __getattr__(self, name):
        fn = getattr(self._agent, name)
        if name not in self.TIMED:
            return fn

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t

        return timed


def stock_worker(local_tp, rank, layout, reg, wrapper, blocks):
    """A NixlPullConnectorWorker with what register_kv_caches leaves behind."""
    from collections import defaultdict

    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    w = object.__new__(NixlPullConnectorWorker)
    r = len(reg.regions)
    # Identity and configuration.
    w.engine_id, w.tp_rank, w.world_size = ENGINE_D, rank, local_tp
    w.transfer_tp_rank, w.transfer_tp_size = rank, local_tp
    w.pcp_size = w.dcp_size = w.pp_size = 1
    w.block_size, w.num_blocks, w._logical_num_blocks = BLOCK_SIZE, blocks, blocks
    w._physical_blocks_per_logical_kv_block = 1
    w.use_mla = w._has_mamba = w._is_csa_linear = w._is_hma_required = False
    w.use_host_buffer = False
    w.device_id, w.nixl_memory_type = 0, "DRAM"
    w.kv_cache_layout = w.host_buffer_kv_cache_layout = "LBHNC"
    w.backend_name = "FLASH_ATTN"
    w.enable_permute_local_kv = w.enable_heterogeneous_attn_post_process = False
    w.compat_hash, w.enforce_compat_hash = COMPAT, True
    w._group_spec_types = (FullAttentionSpec,)
    w._remote_region_offset = 0
    w._transfer_layer_names, w._transfer_layer_region_indices, w._transfer_layer_group_ids = (), (), ()
    w._ssm_region_indices, w._scratch_region_indices = [], []
    w._ple_region_index = w._ple_block_len = None
    w._mamba_ssm_size, w._conv_decomp = (0, 0), None
    w.nixl_wrapper = wrapper
    w.transfer_topo = TransferTopology(
        tp_rank=rank, tp_size=local_tp, block_size=BLOCK_SIZE, engine_id=ENGINE_D, is_mla=False,
        is_mamba=False, total_num_kv_heads=KV_HEADS, attn_backends=[], dcp_size=1,
    )
    # Registration (register_kv_caches).
    w.kv_caches_base_addr = defaultdict(dict)
    w.kv_caches_base_addr[ENGINE_D][rank] = [base for base, _, _, _ in reg.regions]
    w.block_len_per_layer = [blen for _, blen, _, _ in reg.regions]
    w.block_stride_per_layer = [stride for _, _, stride, _ in reg.regions]
    w.region_num_blocks = [n for _, _, _, n in reg.regions]
    w.region_group_ids, w.region_names = [0] * r, list(reg.names)
    w.region_mem_types, w._region_is_mla = ["DRAM"] * r, [False] * r
    w.num_regions, w.num_descs = r, sum(w.region_num_blocks)
    w.region_members = []
    w._uses_region_group_mapping = w._mixed_mem_types = w._skip_dram_xfer = False
    w._desc_is_dram_by_block_size, w._desc_pos_by_block_size = {}, {}
    w._dram_src_handles_by_block_size, w._dram_src_handles_by_tp_ratio = {}, {}
    w.src_xfer_handles_by_block_size, w.src_blocks_data_by_block_size = {}, {}
    w.src_xfer_handles_by_tp_ratio = {}
    w.dst_xfer_side_handles = defaultdict(dict)
    w.dst_num_blocks = {ENGINE_D: blocks}
    w.dst_region_num_blocks = {ENGINE_D: list(w.region_num_blocks)}
    w.dst_region_group_ids = {ENGINE_D: list(w.region_group_ids)}
    w.dst_uses_region_group_mapping = {ENGINE_D: False}
    w.dst_region_mem_types = {ENGINE_D: list(w.region_mem_types)}
    w._remote_agents = defaultdict(dict)
    w.tp_mappings = {}
    return w


def prefill_payload(agent, reg, blocks):
    """The encoded NixlHandshakePayload a prefill rank's side channel serves."""
    import msgspec

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload

    r = len(reg.regions)
    md = NixlAgentMetadata(
        engine_id=ENGINE_P, agent_metadata=agent.get_agent_metadata(), device_id=0, num_blocks=blocks,
        kv_caches_base_addr=[b for b, _, _, _ in reg.regions], block_lens=[bl for _, bl, _, _ in reg.regions],
        block_strides=[s for _, _, s, _ in reg.regions], kv_cache_layout="LBHNC", block_size=BLOCK_SIZE,
        ssm_sizes=(0, 0), attn_backend_name="FLASH_ATTN", physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[n for _, _, _, n in reg.regions], region_group_ids=[0] * r,
        region_names=list(reg.names), region_mem_types=["DRAM"] * r, dcp_size=1, pcp_size=1,
    )
    enc = msgspec.msgpack.Encoder()
    return enc.encode(NixlHandshakePayload(compatibility_hash=COMPAT, agent_metadata_bytes=enc.encode(md)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Setup:
    """Agents, registrations and the prefill side channel for one case."""

    def __init__(self, case, layout):
        import logging

        from nixl._api import nixl_agent, nixl_agent_config

        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

        logging.getLogger("vllm").setLevel(logging.WARNING)  # no per-contact INFO lines on stderr
        name, self.local_tp, self.remote_tp, self.rank, self.blocks = case
        self.layout = layout
        cfg = nixl_agent_config(num_threads=4)
        local_heads = KV_HEADS // self.local_tp
        self.local_reg = Registration(layout, local_heads, self.blocks, reserve(span_for(local_heads, self.blocks)))
        self.local_agent = nixl_agent("decode-0", cfg)
        self.local_agent.register_memory(
            self.local_agent.get_reg_descs([(b, n, 0, "") for b, n in self.local_reg.storages], "DRAM")
        )
        self.wrapper = TimedAgent(self.local_agent)
        remote_heads = KV_HEADS // self.remote_tp
        encoded, self.prefill_agents = {}, []
        for p in range(self.remote_tp):
            reg = Registration(layout, remote_heads, self.blocks, reserve(span_for(remote_heads, self.blocks)))
            agent = nixl_agent(f"prefill-{p}", cfg)
            agent.register_memory(agent.get_reg_descs([(b, n, 0, "") for b, n in reg.storages], "DRAM"))
            self.prefill_agents.append((agent, reg))
            encoded[(0, p)] = prefill_payload(agent, reg, self.blocks)
        self.port = free_port()
        self.stop = threading.Event()
        ready = threading.Event()
        threading.Thread(
            target=NixlBaseConnectorScheduler._nixl_handshake_listener,
            args=(encoded, ready, self.stop, "127.0.0.1", self.port),
            daemon=True,
        ).start()
        ready.wait()
        self.src_handle = None

    def worker(self):
        return stock_worker(self.local_tp, self.rank, self.layout, self.local_reg, self.wrapper, self.blocks)

    def register_time(self):
        """register_local_xfer_handler, as register_kv_caches calls it."""
        w = self.worker()
        self.wrapper.spent = {}
        t = time.perf_counter()
        handle, blocks_data = w.register_local_xfer_handler(BLOCK_SIZE)
        dt = time.perf_counter() - t
        out = {"total": dt, "descs": len(blocks_data), **{"nixl." + k: v for k, v in self.wrapper.spent.items()}}
        return out, handle, blocks_data

    def prepare_local(self):
        _, self.src_handle, self.src_blocks_data = self.register_time()

    def first_contact(self):
        """One first contact; returns timings and the worker (to release)."""
        w = self.worker()
        w.src_xfer_handles_by_block_size[BLOCK_SIZE] = self.src_handle
        w.src_blocks_data = self.src_blocks_data
        inner = {"t": 0.0}
        real_add = w.add_remote_agent

        def add_remote_agent(*a, **kw):  # instance attribute: times the real method
            t = time.perf_counter()
            try:
                return real_add(*a, **kw)
            finally:
                inner["t"] += time.perf_counter() - t

        w.add_remote_agent = add_remote_agent
        self.wrapper.spent = {}
        t = time.perf_counter()
        agents, _ = w._nixl_handshake("127.0.0.1", self.port, self.remote_tp, ENGINE_P)
        total = time.perf_counter() - t
        w._remote_agents[ENGINE_P] = agents
        descs = sum(len(h) for h in w.src_xfer_handles_by_tp_ratio.values())
        out = {
            "total": total,
            "add_remote_agent": inner["t"],
            "ranks": len(agents),
            **{"nixl." + k: v for k, v in self.wrapper.spent.items()},
        }
        out["split_handles"] = descs
        return out, w

    def release(self, w):
        for handles in w.dst_xfer_side_handles.values():
            for h in handles.values():
                self.local_agent.release_dlist_handle(h)
        for handles in w.src_xfer_handles_by_tp_ratio.values():
            for h in handles:
                self.local_agent.release_dlist_handle(h)
        for name in w._remote_agents.get(ENGINE_P, {}).values():
            self.local_agent.remove_remote_agent(name)


def count_remote_descs(setup):
    """Descriptors per remote rank and in the local split lists (from the geometry)."""
    per_rank = sum(n for _, _, _, n in setup.local_reg.regions)
    split = per_rank * setup.remote_tp if setup.remote_tp > setup.local_tp else 0
    return per_rank, split


def child(args):
    case = next(c for c in CASES if c[0] == args.case)
    if args.blocks:
        case = (*case[:4], args.blocks)
    setup = Setup(case, args.layout)
    per_rank, split = count_remote_descs(setup)
    res = {"case": case[0], "layout": args.layout, "mode": args.mode, "descs_per_remote_rank": per_rank,
           "remote_ranks": max(1, setup.remote_tp // setup.local_tp), "split_descs": split}
    if args.mode == "time":
        reg = []
        for _ in range(args.reps):
            r, h, _ = setup.register_time()
            setup.local_agent.release_dlist_handle(h)
            reg.append(r)
        res["register_time"] = reg
        setup.prepare_local()
        runs = []
        for i in range(args.reps + 1):
            gc.collect()
            r, w = setup.first_contact()
            setup.release(w)
            del w
            runs.append(r)
        res["warmup"], res["runs"] = runs[0], runs[1:]
    else:
        # The first contact of a fresh process (no warm-up: freed pages of an
        # earlier contact would stay resident and hide the peak).
        setup.prepare_local()
        gc.collect()
        if args.mode == "trace":
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
        _reset_hwm()
        before = _status()
        r, w = setup.first_contact()
        after = _status()
        res["first_contact"] = r
        res["rss_before"], res["hwm_after"], res["rss_after"] = before["VmRSS"], after["VmHWM"], after["VmRSS"]
        res["hwm_delta"] = after["VmHWM"] - before["VmRSS"]
        res["retained_rss"] = after["VmRSS"] - before["VmRSS"]
        if args.mode == "trace":
            cur, peak = tracemalloc.get_traced_memory()
            res["trace_peak"], res["trace_retained"] = peak - base, cur - base
            tracemalloc.stop()
        setup.release(w)
    setup.stop.set()
    json.dump(res, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    os._exit(0)  # skip agent teardown (the listener thread, UCX workers)


# ---------------------------------------------------------------- parent


def run_child(case, layout, mode, reps, blocks=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--case", case, "--layout", layout,
           "--mode", mode, "--reps", str(reps)] + (["--blocks", str(blocks)] if blocks else [])
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"{case} {layout} {mode}: exit {p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def med_range(xs):
    return statistics.median(xs), min(xs), max(xs)


def fmt_t(sec):
    if sec >= 1:
        return f"{sec:.2f} s"
    if sec >= 1e-3:
        return f"{sec * 1e3:.1f} ms" if sec >= 0.01 else f"{sec * 1e3:.2f} ms"
    return f"{sec * 1e6:.0f} µs"


def fmt_mr(xs):
    m, lo, hi = med_range(xs)
    return f"{fmt_t(m)} ({fmt_t(lo)}–{fmt_t(hi)})"


def fmt_b(n):
    n = float(n)
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


GO_LINE = re.compile(r"^(Benchmark\S+?)(?:-\d+)?\s+(\d+)\s+([\d.]+) ns/op(.*)$")


def parse_go(text):
    out = {}
    for line in text.splitlines():
        m = GO_LINE.match(line.strip())
        if not m:
            continue
        rec = {"ns": float(m.group(3))}
        for val, unit in re.findall(r"([\d.]+) (\S+)", m.group(4)):
            rec[unit] = float(val)
        out.setdefault(m.group(1), []).append(rec)
    return out


def run_gonixl():
    env = dict(os.environ)
    cmds = [
        ["go", "test", "./shim", "-run", "XXX", "-bench", "FirstContactPrepare", "-benchtime", "10x", "-count", "5",
         "-benchmem"],
        ["go", "test", "./nixl/ucx", "-run", "XXX", "-bench", "PrepDescList|MakeXferStrided", "-count", "5",
         "-benchmem"],
    ]
    texts = []
    for c in cmds:
        p = subprocess.run(c, capture_output=True, text=True, cwd=ROOT, env=env)
        if p.returncode != 0:
            sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
            raise SystemExit(f"{' '.join(c)}: exit {p.returncode}")
        texts.append(p.stdout)
    return texts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write all raw results here")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--layouts", default="kv-split,fa-packed")
    ap.add_argument("--blocks", type=int, help="override every case's block count (smoke runs only)")
    ap.add_argument("--gonixl", action="store_true", help="also run gonixl's go benchmarks and add ratios")
    ap.add_argument("--gonixl-from", nargs=2, metavar=("SHIM_TXT", "UCX_TXT"),
                    help="ratios from saved go test -bench outputs instead of running them")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["time", "hwm", "trace"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    results = []
    for case in args.cases.split(","):
        for layout in args.layouts.split(","):
            rec = {"case": case, "layout": layout}
            for mode in ("time", "hwm", "trace"):
                t0 = time.perf_counter()
                rec[mode] = run_child(case, layout, mode, args.reps, args.blocks)
                print(f"# {case} {layout} {mode}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            results.append(rec)

    go = None
    if args.gonixl:
        go = run_gonixl()
    elif args.gonixl_from:
        go = [open(f).read() for f in args.gonixl_from]
    gores = {}
    if go:
        gores = parse_go(go[0])
        gores.update(parse_go(go[1]))

    print(table(results, gores))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename, "python": sys.version,
                       "stock": results, "gonixl_raw": go, "gonixl": gores}, f, indent=1)


def gonixl_case(gores, case, kind):
    runs = gores.get(f"BenchmarkFirstContactPrepare/{case}/{kind}")
    return runs


def ucx_prep(gores, blocks, strided):
    runs = gores.get(f"BenchmarkPrepDescList/{160 * blocks}descs" + ("-strided" if strided else ""))
    return runs


def table(results, gores):
    lines = []
    lines.append("Stock NixlConnector first contact (vLLM's _nixl_handshake → add_remote_agent, real NIXL UCX agent), "
                 "median of runs (range).\n")
    lines.append("| case | layout | descs / remote rank | total (stock) | vLLM Python | NIXL get_xfer_descs "
                 "| NIXL prep_xfer_dlist | NIXL add_remote_agent | peak RSS Δ | tracemalloc peak |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for rec in results:
        t = rec["time"]
        runs = t["runs"]
        tot = [r["total"] for r in runs]
        gx = [r.get("nixl.get_xfer_descs", 0) for r in runs]
        pp = [r.get("nixl.prep_xfer_dlist", 0) for r in runs]
        ad = [r.get("nixl.add_remote_agent", 0) for r in runs]
        py = [r["total"] - a - b - c for r, a, b, c in zip(runs, gx, pp, ad)]
        desc = f"{t['descs_per_remote_rank']:,}"
        if t["remote_ranks"] > 1:
            desc = f"{t['remote_ranks']} × {t['descs_per_remote_rank']:,} + {t['split_descs']:,} local"
        lines.append(
            f"| {rec['case']} | {rec['layout']} | {desc} | **{fmt_mr(tot)}** | {fmt_mr(py)} | {fmt_mr(gx)} "
            f"| {fmt_mr(pp)} | {fmt_mr(ad)} | {fmt_b(rec['hwm']['hwm_delta'])} | {fmt_b(rec['trace']['trace_peak'])} |"
        )
    lines.append("")
    lines.append("Register time (not first contact): register_local_xfer_handler, the local src handle.\n")
    lines.append("| case | layout | local descs | total | of which NIXL get_xfer_descs + prep_xfer_dlist |")
    lines.append("|---|---|---|---|---|")
    for rec in results:
        reg = rec["time"]["register_time"]
        nx = [r.get("nixl.get_xfer_descs", 0) + r.get("nixl.prep_xfer_dlist", 0) for r in reg]
        lines.append(f"| {rec['case']} | {rec['layout']} | {reg[0]['descs']:,} | {fmt_mr([r['total'] for r in reg])} "
                     f"| {fmt_mr(nx)} |")
    if gores:
        lines.append("")
        lines.append("gonixl vs stock (same registration: layout kv-split). gonixl = shim prepare "
                     "(BenchmarkFirstContactPrepare) + ucx engine check (BenchmarkPrepDescList, × remote ranks); "
                     "stock = total above.\n")
        lines.append("| case | gonixl lists | gonixl shim | gonixl engine | gonixl sum | gonixl B/op (shim) "
                     "| stock total | stock / gonixl | gonixl / stock | stock peak RSS Δ |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for rec in results:
            if rec["layout"] != "kv-split":
                continue
            t = rec["time"]
            stock = statistics.median(r["total"] for r in t["runs"])
            blocks = next(c[4] for c in CASES if c[0] == rec["case"])
            for kind in ("strided", "expanded"):
                g = gonixl_case(gores, rec["case"], kind)
                if not g:
                    continue
                shim = [x["ns"] / 1e9 for x in g]
                eng = ucx_prep(gores, blocks, kind == "strided")
                ranks = t["remote_ranks"]
                eng_m = statistics.median(x["ns"] for x in eng) / 1e9 * ranks if eng else 0.0
                s = statistics.median(shim) + eng_m
                bop = statistics.median(x.get("B/op", 0) for x in g)
                eng_s = (f"{ranks} × " if ranks > 1 else "") + fmt_t(eng_m / ranks) if eng else "—"
                lines.append(
                    f"| {rec['case']} | {kind} | {fmt_mr(shim)} | {eng_s} | **{fmt_t(s)}** | {fmt_b(bop)} "
                    f"| {fmt_t(stock)} | {stock / s:,.0f}× | {s / stock:.5f} | {fmt_b(rec['hwm']['hwm_delta'])} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
