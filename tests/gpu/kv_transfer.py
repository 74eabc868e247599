#!/usr/bin/env python3
"""KV-cache transfer between two processes through gonixl's worker path,
checked byte for byte, with the bandwidth measured against baselines.

Two processes (spawned, each loading libgonixl.so itself): a prefill with
KV caches shaped as vLLM's FlashAttention backend allocates them in the HND
layout (per layer one tensor, physical [2, num_blocks, kv_heads,
block_size, head_dim], handed over as the permuted view vLLM registers)
and filled with a seeded pattern; a decode with zeroed caches of the same
shape. Each round the prefill finishes a request holding a scattered set of
blocks (request_finished -> kv_transfer_params), the decode schedules it
(get_num_new_matched_tokens, update_state_after_alloc, build_meta),
start_load_kv posts the READ, and get_finished reports it done; then every
block of every layer, K and V, is compared with the pattern (torch.equal),
as is a block outside the request (must stay zero). The first round also
does the handshake (first contact) and is reported apart.

    python3 tests/gpu/kv_transfer.py --device cuda            # on a GPU host
    python3 tests/gpu/kv_transfer.py --device cpu --layers 2 --blocks 64 --read 16

On CUDA the decode also measures, on the same bytes: one large
device-to-device copy per layer from the prefill's memory through a CUDA
IPC mapping (the practical peak), and one cudaMemcpyAsync per block (a
per-descriptor engine). --staging adds the same rounds with
kv_buffer_device "cpu" (host staging). Results go to stdout and, with
--out, to a JSON file. Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "pybridge"))

BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dtype_of(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def phys_shape(a) -> tuple[int, ...]:
    return (2, a.blocks, a.heads, BLOCK_SIZE, a.head_dim)


def alloc_caches(a, device: str, fill: bool):
    """Per layer the physical tensor and the view vLLM registers: logical
    [2, num_blocks, block_size, kv_heads, head_dim] over HND memory."""
    import torch

    phys, views = [], {}
    for layer in range(a.layers):
        p = torch.zeros(phys_shape(a), dtype=dtype_of(a.dtype), device=device)
        if fill:
            pattern(a, layer, device, out=p)
        phys.append(p)
        views[f"model.layers.{layer}.self_attn.attn"] = p.permute(0, 1, 3, 2, 4)
    return phys, views


def pattern(a, layer: int, device: str, out=None):
    import torch

    g = torch.Generator(device=device)
    g.manual_seed(1000 + layer)
    if out is None:
        out = torch.empty(phys_shape(a), dtype=dtype_of(a.dtype), device=device)
    return torch.randn(phys_shape(a), generator=g, device=device, dtype=dtype_of(a.dtype), out=out)


def config(a, kv_role: str, engine_id: str, port: int, buffer_device: str) -> dict:
    return {
        "kv_role": kv_role,
        "engine_id": engine_id,
        "kv_buffer_device": buffer_device,
        "tp_size": 1,
        "tp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "dp_index": 0,
        "block_size": BLOCK_SIZE,
        "side_channel_host": "127.0.0.1",
        "side_channel_port": port,
        "kv_connector_extra_config": {"transfer_engine": a.engine, "kv_lease_duration": 120},
        "compat_factors": {
            "model": "gpu-kv-transfer-test",
            "dtype": "torch." + a.dtype,
            "num_kv_heads": a.heads,
            "head_size": a.head_dim,
            "num_hidden_layers": a.layers,
        },
    }


class Side:
    """One instance: scheduler and worker handles over its KV caches."""

    def __init__(self, a, kv_role: str, engine_id: str, fill: bool, buffer_device: str):
        from gonixl.engine import HostStaging, Scheduler, Worker, layer_descriptions

        self.port = free_port()
        self.phys, views = alloc_caches(a, a.device, fill)
        self.staging = None
        if buffer_device == "cpu" and a.device != "cpu":
            # Host staging: the engine registers and moves pinned host
            # mirrors of the device caches.
            self.staging = HostStaging(views, a.blocks)
            views = self.staging.host_caches
        cfg = config(a, kv_role, engine_id, self.port, buffer_device)
        self.sched = Scheduler(cfg)
        self.work = Worker(cfg)
        payload = self.work.register_kv_caches(layer_descriptions(views), a.blocks, BLOCK_SIZE, "FLASH_ATTN", "LBHNC")
        self.sched.set_handshake_payload(0, 0, payload)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()

    def step(self) -> None:
        self.work.start_load_kv(self.sched.build_meta())

    def poll(self) -> None:
        f = self.work.get_finished()
        self.sending.update(f.finished_sending)
        self.recving.update(f.finished_recving)
        self.failed.update(f.failed_recving)

    def close(self) -> None:
        self.work.close()
        self.sched.close()


def prefill_main(a, conn, buffer_device: str) -> None:
    """Serves prefill requests from the decode over conn until told to stop."""
    import torch  # CUDA tensors travel over conn as IPC handles

    try:
        if a.device == "cuda":
            torch.cuda.set_device(a.prefill_gpu)
        p = Side(a, "kv_producer", "gpu-test-prefill", True, buffer_device)
        if a.device == "cuda":
            torch.cuda.synchronize()
        conn.send(("ready", p.port))
        while True:
            if not conn.poll(0.001):
                p.step()
                p.poll()
                continue
            msg = conn.recv()
            if msg[0] == "prefill":
                _, req, blocks = msg
                params = {"do_remote_decode": True, "do_remote_prefill": False}
                ntok = len(blocks) * BLOCK_SIZE
                p.sched.get_num_new_matched_tokens(params, ntok, 0)
                p.sched.update_state_after_alloc(req, params, [], [0], 0)
                p.step()
                if p.staging is not None:
                    p.staging.save_to_host(blocks)  # vLLM's wait_for_save, in the step that computed them
                delay, out = p.sched.request_finished(req, params, [blocks], True, ntok)
                p.step()
                conn.send(("params", delay, out))
            elif msg[0] == "sent?":
                deadline = time.monotonic() + 30
                while msg[1] not in p.sending and time.monotonic() < deadline:
                    p.step()
                    p.poll()
                    time.sleep(0.0005)
                conn.send(("sent", msg[1] in p.sending))
            elif msg[0] == "tensors":
                conn.send(("tensors", p.phys))
            elif msg[0] == "live":
                conn.send(("live", {**p.work.live(), **p.sched.live()}))
            elif msg[0] == "stop":
                p.close()
                conn.send(("stopped",))
                return
    except Exception:
        conn.send(("error", traceback.format_exc()))


def expect(conn, tag: str, timeout: float = 600.0):
    if not conn.poll(timeout):
        raise RuntimeError(f"prefill did not answer ({tag}) within {timeout} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError("prefill failed:\n" + msg[1])
    if msg[0] != tag:
        raise RuntimeError(f"prefill answered {msg[0]}, want {tag}")
    return msg


def sync(a) -> None:
    if a.device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_rounds(a, d: Side, conn, label: str, results: dict) -> None:
    import torch

    rng = random.Random(a.seed)
    n = a.read
    per_block = 2 * a.heads * BLOCK_SIZE * a.head_dim * torch.tensor([], dtype=dtype_of(a.dtype)).element_size()
    nbytes = n * a.layers * per_block
    times, posts = [], []
    first = None
    usable = list(range(1, a.blocks))  # block 0 is vLLM's null block
    for r in range(a.rounds + 1):
        remote = rng.sample(usable, n)
        local = rng.sample(usable, n)
        outside = 0  # the null block: in no request, must stay zero
        req = f"{label}-{r}"
        conn.send(("prefill", "p-" + req, remote))
        _, delay, params = expect(conn, "params")
        if not delay or not params:
            raise RuntimeError(f"prefill did not hold the blocks: delay={delay} params={params}")
        ntok = n * BLOCK_SIZE
        d.sched.on_new_request(req, params)
        got, is_async = d.sched.get_num_new_matched_tokens(params, ntok, 0)
        if got != ntok or not is_async:
            raise RuntimeError(f"decode matched {got} tokens async={is_async}, want {ntok} True")
        d.sched.update_state_after_alloc(req, params, [local], [0], got)
        meta = d.sched.build_meta()
        sync(a)
        t0 = time.perf_counter()
        d.work.start_load_kv(meta)
        t_post = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while req not in d.recving and req not in d.failed:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{req}: READ not finished in 120 s")
            d.poll()
        elapsed = time.perf_counter() - t0
        if req in d.failed:
            raise RuntimeError(f"{req}: READ failed; load errors {d.work.load_errors()[:8]}")
        if d.staging is not None:
            d.staging.load_to_device(local)  # before the blocks are reported received
            elapsed = time.perf_counter() - t0
        d.sched.update_connector_output([req])
        d.step()
        # Check every block of every layer, K and V, against the pattern.
        li = torch.tensor(local, device=a.device)
        ri = torch.tensor(remote, device=a.device)
        for layer in range(a.layers):
            want = pattern(a, layer, a.device).index_select(1, ri)
            have = d.phys[layer].index_select(1, li)
            if not torch.equal(have, want):
                bad = (have != want).reshape(2, n, -1).any(dim=2).nonzero()[:4].tolist()
                raise RuntimeError(f"{req}: layer {layer}: blocks differ from the prefill's (kv, i) {bad}")
            if torch.count_nonzero(d.phys[layer][:, outside]).item() != 0:
                raise RuntimeError(f"{req}: layer {layer}: block {outside}, outside the request, was written")
            d.phys[layer].index_fill_(1, li, 0)
        conn.send(("sent?", "p-" + req))
        if not expect(conn, "sent")[1]:
            raise RuntimeError(f"{req}: the prefill never saw the decode's notification")
        if r == 0:
            first = elapsed
        else:
            times.append(elapsed)
            posts.append(t_post)
    med = statistics.median(times)
    st = d.work.stats() or {}
    results[label] = {
        "blocks": n,
        "descriptors": n * a.layers * 2,
        "bytes": nbytes,
        "first_contact_s": first,
        "read_s_median": med,
        "staging": d.staging is not None,
        "read_s_all": times,
        "GBps_median": nbytes / med / 1e9,
        "start_load_kv_s_median": statistics.median(posts),
        "go_stats": {k: v[-3:] if isinstance(v, list) else v for k, v in st.items()},
    }
    print(
        f"{label}: {n} blocks x {a.layers} layers x K/V = {n * a.layers * 2} descriptors, {nbytes / 2**20:.0f} MiB: "
        f"READ median {med * 1e3:.2f} ms = {nbytes / med / 1e9:.1f} GB/s over {len(times)} rounds "
        f"(first contact {first * 1e3:.1f} ms; start_load_kv {statistics.median(posts) * 1e6:.0f} us); every byte checked",
        flush=True,
    )


def baselines(a, d: Side, conn, results: dict) -> None:
    """The same bytes moved from the prefill's memory without gonixl."""
    import torch

    conn.send(("tensors",))
    src = expect(conn, "tensors")[1]  # the prefill's tensors, mapped here through CUDA IPC
    n = a.read
    blk = a.heads * BLOCK_SIZE * a.head_dim * src[0].element_size()
    nbytes = n * a.layers * 2 * blk
    # Peak: per layer one copy of as many contiguous bytes as the READ moves.
    per_layer = nbytes // a.layers
    flat_s = [t.view(-1).view(torch.uint8) for t in src]
    flat_d = [t.view(-1).view(torch.uint8) for t in d.phys]
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for layer in range(a.layers):
            flat_d[layer][:per_layer].copy_(flat_s[layer][:per_layer])
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    peak = statistics.median(ts)
    # One cudaMemcpyAsync per block (a per-descriptor engine).
    rng = random.Random(a.seed + 1)
    usable = list(range(1, a.blocks))
    remote, local = rng.sample(usable, n), rng.sample(usable, n)
    try:
        import cupy

        def memcpy(dst: int, s: int, size: int, stream: int) -> None:
            cupy.cuda.runtime.memcpyAsync(dst, s, size, 3, stream)

        how = "cupy.cuda.runtime.memcpyAsync"
    except ImportError:
        memcpy = None
        how = "torch copy_ per block"
    stream = torch.cuda.Stream()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for layer in range(a.layers):
            sb, db = src[layer].data_ptr(), d.phys[layer].data_ptr()
            for kv in range(2):
                for rb, lb in zip(remote, local):
                    so = sb + (kv * a.blocks + rb) * blk
                    do = db + (kv * a.blocks + lb) * blk
                    if memcpy is not None:
                        memcpy(do, so, blk, stream.cuda_stream)
                    else:
                        d.phys[layer][kv, lb].copy_(src[layer][kv, rb], non_blocking=True)
    stream.synchronize()
    per = time.perf_counter() - t0
    for layer in range(a.layers):
        d.phys[layer].zero_()
    torch.cuda.synchronize()
    del src, flat_s
    results["baselines"] = {
        "bytes": nbytes,
        "ipc_copy_per_layer_s_median": peak,
        "ipc_copy_GBps": nbytes / peak / 1e9,
        "per_block_copies": n * a.layers * 2,
        "per_block_s": per,
        "per_block_GBps": nbytes / per / 1e9,
        "per_block_how": how,
    }
    print(
        f"baselines on the same {nbytes / 2**20:.0f} MiB: large copies through a CUDA IPC mapping "
        f"{nbytes / peak / 1e9:.1f} GB/s ({peak * 1e3:.2f} ms); one copy per block ({how}) "
        f"{nbytes / per / 1e9:.2f} GB/s ({per * 1e3:.0f} ms for {n * a.layers * 2} copies)",
        flush=True,
    )


def run(a, buffer_device: str, label: str, results: dict, with_baselines: bool) -> None:
    import torch.multiprocessing as tmp

    if a.device == "cuda":
        import torch

        torch.cuda.set_device(a.decode_gpu)
    ctx = tmp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(a, child, buffer_device), daemon=True)
    proc.start()
    d = None
    try:
        expect(parent, "ready")
        d = Side(a, "kv_consumer", "gpu-test-decode", False, buffer_device)
        reads = [a.read] + [x for x in a.also_read if x != a.read]
        for n in reads:
            a.read = n
            run_rounds(a, d, parent, f"{label}-{n}", results)
        a.read = reads[0]
        if with_baselines:
            baselines(a, d, parent, results)
        parent.send(("live",))
        live = expect(parent, "live")[1]
        holding = ("transfer_handles", "stuck_handles", "receiving_requests", "held_leases", "pending_handshakes", "awaiting_kv", "send_pending", "panics")
        held = {k: live[k] for k in holding if live.get(k)}
        if held:
            raise RuntimeError(f"prefill still holds {held} after every round")
        parent.send(("stop",))
        expect(parent, "stopped")
    finally:
        if d is not None:
            d.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--engine", default="ucx", help="transfer_engine (ucx, nixl, auto)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--blocks", type=int, default=8192, help="KV-cache blocks per process")
    ap.add_argument("--read", type=int, default=2048, help="blocks per request")
    ap.add_argument("--also-read", type=int, nargs="*", default=[], help="further request sizes, same run")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds after the first")
    ap.add_argument("--staging", action="store_true", help="also kv_buffer_device cpu (host staging)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the CUDA IPC and per-block copy baselines")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--prefill-gpu", type=int, default=0, help="the prefill process's GPU")
    ap.add_argument("--decode-gpu", type=int, default=0, help="the decode process's GPU (both must be visible to both)")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device visible to torch (this test needs a GPU for --device cuda)")
        return 0
    results: dict = {"argv": sys.argv[1:], "torch": torch.__version__}
    if a.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(a.decode_gpu)
        results["gpus"] = {"prefill": a.prefill_gpu, "decode": a.decode_gpu, "visible": torch.cuda.device_count()}
        if max(a.prefill_gpu, a.decode_gpu) >= torch.cuda.device_count():
            print(f"SKIP: --prefill-gpu {a.prefill_gpu} --decode-gpu {a.decode_gpu} need {max(a.prefill_gpu, a.decode_gpu) + 1} GPUs, {torch.cuda.device_count()} visible")
            return 0
    import gonixl

    results["gonixl"] = gonixl.library_version()
    run(a, a.device, "direct", results, a.device == "cuda" and not a.no_baselines)
    if a.staging:
        run(a, "cpu", "staging", results, False)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print("PASS: every block of every round matched the prefill's pattern")
    return 0


if __name__ == "__main__":
    sys.exit(main())
