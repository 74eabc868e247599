#!/usr/bin/env python3
"""./build.sh demo: disaggregated prefill -> decode through gonixl, end to end.

Prints the library and what it finds on this host, starts a prefill vLLM
(kv_producer) and a decode vLLM (kv_consumer) with GoNixlConnector and the
tiny fixture model — `vllm serve`, exactly as vLLM's disaggregated-serving
guide starts its NixlConnector — puts gonixl-proxy (toy mode) in front,
sends a handful of requests (prompt, output, time to first token), runs a
short `vllm bench serve` through the proxy, prints the decode's "KV
Transfer metrics" line and the NIXL Prometheus counters, and shuts
everything down. Every wait has a deadline; every process started here is
stopped on exit.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
import model_task  # noqa: E402

PY = os.path.join(ROOT, ".venv", "bin", "python")
# vLLM's own command (./build.sh setup installs tools/vllm-cli over the CPU
# build's, which cannot start: it asks for the "vllm" distribution).
VLLM = os.path.join(ROOT, ".venv", "bin", "vllm")
PROXY = os.path.join(ROOT, "build", "bin", "gonixl-proxy")
MODEL = os.path.join(ROOT, "tests", "fixtures", "tiny-copy-model")
STARTUP_DEADLINE = float(os.environ.get("GONIXL_DEMO_TIMEOUT", "600"))


def free_port() -> int:
    """A free port below the kernel's ephemeral range, so that none of the
    sockets vLLM binds to OS-chosen ports can take it before our servers do."""
    lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(200):
        port = random.randrange(20000, max(20001, min(lo, 32768)))
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    raise RuntimeError("no free port below the ephemeral range")


def section(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


class Procs:
    def __init__(self, logdir: str):
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict) -> str:
        log = os.path.join(self.logdir, f"{name}.log")
        f = open(log, "w")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append((name, p))
        return log

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}; see {self.logdir}/{name}.log")

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for _, p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_ready(procs: Procs, name: str, url: str) -> None:
    deadline = time.time() + STARTUP_DEADLINE
    while time.time() < deadline:
        procs.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=2):
                print(f"{name} ready", flush=True)
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{name} not ready after {STARTUP_DEADLINE:.0f}s")


def stream_completion(url: str, prompt: str, max_tokens: int) -> tuple[str, float, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    text = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = chunk["choices"][0].get("text", "")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
    return "".join(text), (ttft or 0.0), time.perf_counter() - t0


def main() -> int:
    import gonixl

    section("libgonixl")
    info = gonixl.probe()
    print(f"version {info['version']} (ABI {gonixl.abi_version()}, {info['go_version']}), loaded from {gonixl._lib.library_path()}")
    for e in info["engines"]:
        state = f"available: {e['info']}" if e["available"] else f"not available: {e['reason']}"
        print(f"  transfer engine {e['name']:5s} {state}")

    logdir = tempfile.mkdtemp(prefix="gonixl-demo-")
    procs = Procs(logdir)
    try:
        p_port, d_port, x_port, p_side, d_side = (free_port() for _ in range(5))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                   OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_NO_USAGE_STATS="1")
        common = [VLLM, "serve", MODEL, "--enforce-eager", "--dtype", "float32",
                  "--block-size", "32", "--max-model-len", "1024", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(256 << 20)]

        engine = os.environ.get("GONIXL_DEMO_ENGINE", "ucx")

        def kvcfg(role: str) -> str:
            return json.dumps({"kv_connector": "GoNixlConnector", "kv_connector_module_path": "gonixl.vllm", "kv_role": role,
                               "kv_connector_extra_config": {"transfer_engine": engine}})

        section(f"starting prefill, decode and proxy; transfer_engine={engine} (logs in {logdir})")
        procs.start("prefill", common + ["--port", str(p_port), "--kv-transfer-config", kvcfg("kv_producer")],
                    dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(p_side)))
        d_log = procs.start("decode", common + ["--port", str(d_port), "--kv-transfer-config", kvcfg("kv_consumer")],
                            dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(d_side)))
        procs.start("proxy", [PROXY, "--port", str(x_port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(p_port),
                              "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(d_port)], env)
        wait_ready(procs, "proxy", f"http://127.0.0.1:{x_port}/healthcheck")
        wait_ready(procs, "prefill", f"http://127.0.0.1:{p_port}/health")
        wait_ready(procs, "decode", f"http://127.0.0.1:{d_port}/health")

        section("requests through gonixl-proxy (prefill computes the KV, decode pulls it)")
        exs = model_task.examples(11, [40, 65, 130, 300])
        for ex in exs:
            out, ttft, total = stream_completion(f"http://127.0.0.1:{x_port}", ex.prompt, model_task.MAX_KEY_LEN + 2)
            shown = ex.prompt if len(ex.prompt) <= 60 else ex.prompt[:28] + "..." + ex.prompt[-28:]
            ok = "correct" if model_task.score(ex, out) else "WRONG"
            print(f"prompt ({len(ex.prompt)} tokens) {shown!r}\n  -> {out.strip()!r} (expected {ex.answer!r}, {ok}); "
                  f"TTFT {ttft * 1000:.0f} ms, total {total * 1000:.0f} ms")

        section("vllm bench serve through gonixl-proxy (random prompts of 64 tokens, 8 output tokens)")
        bench = subprocess.run(
            [VLLM, "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{x_port}", "--model", MODEL,
             "--dataset-name", "random", "--input-len", "64", "--output-len", "8", "--num-prompts", "8",
             "--max-concurrency", "2", "--ignore-eos", "--disable-tqdm", "--seed", "1"],
            capture_output=True, text=True, env=env, timeout=STARTUP_DEADLINE)
        summary = [ln for ln in bench.stdout.splitlines() if re.match(r"(Successful requests|Failed requests|Mean TTFT|Output token throughput|Total token throughput)", ln)]
        print("\n".join(summary) or bench.stdout[-2000:])
        if bench.returncode != 0 or not any(ln.startswith("Successful requests") and ln.split()[-1] == "8" for ln in summary):
            print(f"vllm bench serve failed (exit {bench.returncode}):\n{bench.stderr[-3000:]}")
            return 1

        section("KV transfer metrics (decode)")
        pat = re.compile(r"KV Transfer metrics: .*")
        deadline = time.time() + 30
        line = None
        while time.time() < deadline and line is None:
            with open(d_log, errors="replace") as f:
                found = pat.findall(f.read())
            line = found[-1] if found else None
            if line is None:
                time.sleep(1)
        print(line or "(no KV Transfer metrics line logged within 30 s)")

        section("Prometheus counters (decode /metrics)")
        with urllib.request.urlopen(f"http://127.0.0.1:{d_port}/metrics", timeout=30) as r:
            text = r.read().decode()
        for ln in text.splitlines():
            if ln.startswith(("vllm:nixl_", 'vllm:prompt_tokens_by_source')) and not ln.startswith("#") and "_bucket" not in ln and "_created" not in ln:
                print(ln)
        return 0
    finally:
        section("shutting down")
        procs.stop()
        print("all processes stopped")


if __name__ == "__main__":
    sys.exit(main())
