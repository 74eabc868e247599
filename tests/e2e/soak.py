"""Soak test with leak accounting for gonixl's disaggregated prefill -> decode.

Started by run_soak_test.sh, which brings up a prefill vLLM (kv_producer) and
a decode vLLM (kv_consumer), both with GoNixlConnector, a short
kv_lease_duration and GONIXL_METRICS_PORT (gonixl's metrics server in each
engine process), gonixl-proxy (toy P/D mode) in front, and an aggregated
vLLM without a connector as the baseline.

Load: GONIXL_SOAK_REQUESTS requests, GONIXL_SOAK_CONCURRENCY at a time,
through the proxy: prompts from 1 token to 16 blocks drawn (with repeats,
so prefix-cache hits happen on both sides) from a pool, max_tokens from 1
to 64 (stopping at the end-of-sequence token, or ignoring it for long
outputs), half streamed; a fraction of 256-token streams is dropped by the
client after one or two chunks (disconnected), a fraction of requests is
cancelled by the client a random time after sending (aborted: before the
prefill, in it, between prefill and decode, or in the decode; vLLM's
request log says where each landed).

Phases: baseline (every distinct prompt once on the aggregated vLLM,
greedy, EOS ignored; every expectation is a prefix of it); warm-up (the
first 10% of the requests, at least 100), drain, settle, snapshot of both
engine processes (goroutines, RSS, Go heap, live gauges); main load;
drain; settle (kv_lease_duration + margin); final snapshot. A summary is
printed and, with GONIXL_SOAK_SUMMARY, written as JSON.

Fails (exit 1) when:
- a completed response (HTTP 200, whole body) differs from the baseline in
  any token (printed);
- a request hangs past DEADLINE_S (the client's per-request deadline), or
  any non-aborted, non-disconnected request errors;
- the decode's log has a failed load other than a lapsed lease (the decode
  runs kv_load_failure_policy recompute: a lapsed lease is recomputed and
  counted, any other failure fails the soak);
- at the end, on either side, any of gonixl's live gauges (transfer handles,
  stuck handles, receiving requests, held leases, pending handshakes, the
  scheduler's awaiting-KV / send-pending / heartbeat leases) is not 0, a
  background panic was recovered, goroutines exceed the post-warm-up count
  by more than GOROUTINE_MARGIN, RSS or the Go heap grew by more than their
  margins, vLLM's KV-cache usage or running/waiting requests are not 0;
- a gauge is not exported, or an engine logged "metrics server not started";
- the decode pulled no KV at all (the soak would not have tested gonixl);
- an engine log mentions a panic.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import os
import random
import re
import statistics
import sys
import time

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from e2e_common import BLOCK, gonixl_metrics_urls, metrics, model_task, read_from, samples  # noqa: E402


def _env(name: str, default: str) -> str:
    v = os.environ.get(name, "")
    return v if v != "" else default


N_REQUESTS = int(_env("GONIXL_SOAK_REQUESTS", "2000"))
CONCURRENCY = int(_env("GONIXL_SOAK_CONCURRENCY", "32"))
SEED = int(_env("GONIXL_SOAK_SEED", "2026"))
# The client's deadline for one request, from sending to the last byte. A
# request still open after it is a hang (a failure).
DEADLINE_S = float(_env("GONIXL_SOAK_DEADLINE", "120"))
DISCONNECT_FRAC = float(_env("GONIXL_SOAK_DISCONNECT_FRAC", "0.05"))
ABORT_FRAC = float(_env("GONIXL_SOAK_ABORT_FRAC", "0.05"))
# Warm-up: the first 10% of the requests, at least 100 (half of a short run):
# an engine's RSS still climbs over its first hundred or so requests
# (allocator, Python, vLLM caches), with or without gonixl.
WARMUP_FRAC = 0.10
WARMUP_MIN = 100
# kv_lease_duration the engines run with (run_soak_test.sh passes it), and
# the wait after the load before the final snapshot: every lease a
# disconnected or aborted request left behind has ended by then.
LEASE_S = float(_env("GONIXL_SOAK_LEASE", "10"))
SETTLE_S = LEASE_S + float(_env("GONIXL_SOAK_SETTLE_MARGIN", "5"))
# How much the resting goroutine count and RSS of an engine process may
# exceed their post-warm-up values at the end.
GOROUTINE_MARGIN = int(_env("GONIXL_SOAK_GOROUTINE_MARGIN", "20"))
# RSS: measured growth from post-warm-up to the end, with oneDNN's primitive
# cache off (run_soak_test.sh): 2000 requests +4 MiB (prefill), +2 MiB
# (decode); 500 requests (warm-up 100, the engine still settling) +12..22 MiB
# (prefill), +1..3 MiB (decode). The margin is the larger of the two knobs.
RSS_MARGIN_MIB = float(_env("GONIXL_SOAK_RSS_MARGIN_MIB", "48"))
RSS_MARGIN_PCT = float(_env("GONIXL_SOAK_RSS_MARGIN_PCT", "0"))
# The Go heap in use (go_memstats_heap_inuse_bytes) of an engine process may
# exceed its post-warm-up value by this much at the end.
GO_HEAP_MARGIN_MIB = float(_env("GONIXL_SOAK_GO_HEAP_MARGIN_MIB", "16"))
BASELINE_CONCURRENCY = 16  # the baseline's --max-num-seqs
# Distinct prompts: about four uses each.
POOL = max(32, N_REQUESTS // 4)
MAX_PROMPT = model_task.MAX_PROMPT_LEN  # 512 tokens = 16 blocks; the fixture's max_model_len is 1024
# max_tokens profiles: (max_tokens, ignore_eos). The copy task's answer is
# up to 8 tokens then EOS; ignore_eos makes the long outputs.
STOP_PROFILES = [(1, False), (2, False), (4, False), (8, False), (10, False), (16, False)]
LONG_PROFILES = [(16, True), (32, True), (64, True)]
# Streams the client drops: long enough (prompt <= 512, + 256 <= max_model_len
# 1024) that the decode is still generating when the proxy cancels it.
DISCONNECT_MAX_TOKENS = 256
EOS_ID = 2  # the fixture tokenizer's </s>; vLLM's token_ids include it when a request stops on it

PROXY = os.environ["GONIXL_E2E_PROXY"]
BASELINE = os.environ["GONIXL_E2E_BASELINE"]
PREFILL = os.environ["GONIXL_E2E_PREFILL"]
DECODE = os.environ["GONIXL_E2E_DECODE"]
MODEL = os.environ["GONIXL_E2E_MODEL"]
# Per side: vLLM's API server, the gonixl metrics server at GONIXL_METRICS_PORT
# (the worker's), the log. "procs" (role -> metrics URL, one per engine
# process that serves) is filled from the logs' "gonixl metrics served" lines.
SIDES = {
    "prefill": {"vllm": PREFILL, "gonixl": os.environ["GONIXL_SOAK_PREFILL_METRICS"], "log": os.environ["GONIXL_E2E_PREFILL_LOG"], "procs": {}},
    "decode": {"vllm": DECODE, "gonixl": os.environ["GONIXL_SOAK_DECODE_METRICS"], "log": os.environ["GONIXL_E2E_DECODE_LOG"], "procs": {}},
}
RUN_ID = "%06x" % random.randrange(1 << 24)  # request ids soak-RUN_ID-i (X-Request-Id), found again in the vLLM logs
SUMMARY_PATH = os.environ.get("GONIXL_SOAK_SUMMARY", "")

# Must be 0 at rest on both sides.
LIVE_GAUGES = [
    "gonixl_live_transfer_handles",
    "gonixl_stuck_transfer_handles",
    "gonixl_receiving_requests",
    "gonixl_held_leases",
    "gonixl_pending_handshakes",
    "gonixl_scheduler_awaiting_kv",
    "gonixl_scheduler_send_pending",
    "gonixl_scheduler_heartbeat_leases",
]
ZERO_COUNTERS = ["gonixl_background_panics_total"]
INFO = [
    "gonixl_remote_engines",
    "gonixl_handshakes_refused_total",
    "gonixl_side_channel_served_total",
    "gonixl_side_channel_refused_total",
    "vllm:nixl_num_failed_transfers",
    "vllm:nixl_num_failed_notifications",
    "vllm:nixl_num_kv_expired_reqs",
    "vllm:nixl_num_notifications_after_expiry",
    "vllm:nixl_xfer_time_seconds_count",
]
PROC = ["go_goroutines", "process_resident_memory_bytes"]
# Reported with them: how much of the RSS is the Go heap.
PROC_INFO = ["go_memstats_heap_inuse_bytes", "go_memstats_sys_bytes"]
VLLM_ZERO = ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"]
MIB = 1 << 20


def say(*a) -> None:
    print("soak:", *a, flush=True)


# ---------------------------------------------------------------- the plan


@dataclasses.dataclass
class Req:
    i: int
    prompt: int  # index into the pool
    max_tokens: int
    ignore_eos: bool
    stream: bool
    kind: str  # normal | disconnect | abort
    abort_frac: float = 0.0  # abort: wait this fraction of the running median latency, then cancel
    disconnect_after: int = 1  # disconnect: data chunks read before closing


@dataclasses.dataclass
class Result:
    req: Req
    outcome: str  # completed | disconnected | aborted | error | hung
    latency: float = 0.0
    status: int = 0
    token_ids: list[int] | None = None
    text: str = ""
    detail: str = ""
    verdict: str = ""  # correct | wrong (completed only)


def make_plan(n: int, seed: int) -> tuple[list[str], list[Req]]:
    rng = random.Random(seed)
    # eval_lengths: 1 token, one block, one block + 1, k blocks, 16 blocks, then log-uniform.
    lengths = model_task.eval_lengths(POOL, seed, block_size=BLOCK, max_len=MAX_PROMPT)
    prompts = [e.prompt for e in model_task.examples(seed, lengths)]
    reqs = []
    for i in range(n):
        u = rng.random()
        if u < DISCONNECT_FRAC:
            # Long streams, so that the client leaves while the decode still generates.
            reqs.append(Req(i, rng.randrange(len(prompts)), DISCONNECT_MAX_TOKENS, True, True, "disconnect",
                            disconnect_after=rng.choice([1, 2])))
            continue
        mt, ign = rng.choice(STOP_PROFILES) if rng.random() < 0.6 else rng.choice(LONG_PROFILES)
        stream = rng.random() < 0.5
        if u < DISCONNECT_FRAC + ABORT_FRAC:
            reqs.append(Req(i, rng.randrange(len(prompts)), mt, ign, stream, "abort", abort_frac=rng.random()))
        else:
            reqs.append(Req(i, rng.randrange(len(prompts)), mt, ign, stream, "normal"))
    return prompts, reqs


# ---------------------------------------------------------------- HTTP


def body_of(prompt: str, max_tokens: int, ignore_eos: bool, stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "ignore_eos": ignore_eos,
        "stream": stream,
        "return_token_ids": True,
    }


async def send(session: aiohttp.ClientSession, url: str, body: dict, res: Result, chunks_before_close: int = 0) -> None:
    """POST body to url/v1/completions and fill res. chunks_before_close > 0:
    close the connection after that many data chunks (a client that leaves)."""
    headers = {"X-Request-Id": f"soak-{RUN_ID}-{res.req.i}"} if res.req.i >= 0 else {}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        res.status = resp.status
        if resp.status != 200:
            res.outcome, res.detail = "error", (await resp.text())[:300]
            return
        if not body["stream"]:
            data = await resp.json(content_type=None)
            ch = data["choices"][0]
            res.token_ids, res.text, res.outcome = list(ch.get("token_ids") or []), ch.get("text", ""), "completed"
            return
        ids: list[int] = []
        text = []
        n = 0
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                res.outcome, res.detail = "error", json.dumps(obj)[:300]
                return
            for ch in obj.get("choices", []):
                ids.extend(ch.get("token_ids") or [])
                text.append(ch.get("text") or "")
            n += 1
            if chunks_before_close and n >= chunks_before_close:
                resp.close()  # drop the connection mid-stream
                res.outcome, res.detail = "disconnected", f"after {n} chunks"
                return
        res.token_ids, res.text = ids, "".join(text)
        if done:
            res.outcome = "completed"
        else:
            res.outcome, res.detail = "error", f"stream ended without [DONE] after {n} chunks"


class Latencies:
    """Running median of completed requests' latency (the abort delays scale with it)."""

    def __init__(self) -> None:
        self.v: list[float] = []

    def median(self) -> float:
        return statistics.median(self.v[-200:]) if self.v else 0.5


async def run_one(session: aiohttp.ClientSession, prompts: list[str], r: Req, lat: Latencies) -> Result:
    res = Result(r, "error")
    body = body_of(prompts[r.prompt], r.max_tokens, r.ignore_eos, r.stream)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(DEADLINE_S):
            if r.kind == "abort":
                task = asyncio.create_task(send(session, PROXY, body, res))
                done, _ = await asyncio.wait({task}, timeout=r.abort_frac * lat.median())
                if task in done:
                    task.result()  # finished before the client gave up: checked like any other
                    res.detail = "abort came too late"
                else:
                    task.cancel()  # the connection is closed: the proxy cancels upstream, vLLM aborts
                    await asyncio.gather(task, return_exceptions=True)
                    res.outcome = "aborted"
            elif r.kind == "disconnect":
                await send(session, PROXY, body, res, chunks_before_close=r.disconnect_after)
            else:
                await send(session, PROXY, body, res)
    except TimeoutError:
        res.outcome, res.detail = "hung", f"no complete response within {DEADLINE_S:.0f}s"
    except (aiohttp.ClientError, ConnectionError, asyncio.IncompleteReadError, json.JSONDecodeError, KeyError, IndexError) as e:
        res.outcome, res.detail = "error", f"{type(e).__name__}: {e}"[:300]
    res.latency = time.monotonic() - t0
    if res.outcome == "completed":
        lat.v.append(res.latency)
    return res


async def run_load(session, prompts, reqs: list[Req], lat: Latencies, label: str) -> list[Result]:
    q: asyncio.Queue[Req] = asyncio.Queue()
    for r in reqs:
        q.put_nowait(r)
    out: list[Result] = []
    t0 = time.monotonic()
    last = [t0]

    async def worker() -> None:
        while True:
            try:
                r = q.get_nowait()
            except asyncio.QueueEmpty:
                return
            out.append(await run_one(session, prompts, r, lat))
            now = time.monotonic()
            if now - last[0] > 30:
                last[0] = now
                say(f"{label}: {len(out)}/{len(reqs)} done, {now - t0:.0f}s")

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return out


# ---------------------------------------------------------------- baseline


async def baseline_one(session, prompt: str, max_tokens: int, ignore_eos: bool) -> list[int]:
    res = Result(Req(-1, -1, max_tokens, ignore_eos, False, "normal"), "error")
    async with asyncio.timeout(DEADLINE_S):
        await send(session, BASELINE, body_of(prompt, max_tokens, ignore_eos, False), res)
    if res.outcome != "completed" or res.token_ids is None:
        raise RuntimeError(f"baseline failed: {res.outcome} HTTP {res.status} {res.detail}")
    if not res.token_ids and max_tokens > 0:
        raise RuntimeError("baseline returned no token_ids (return_token_ids unsupported?)")
    return res.token_ids


async def baseline(session, prompts: list[str], reqs: list[Req]) -> dict[int, list[int]]:
    """Greedy token ids per prompt, ignoring EOS, at the largest max_tokens a
    request for it asks for (the dropped streams' 256 left out: they are not
    meant to complete). Every expectation is derived from it (expected())."""
    need: dict[int, int] = {}
    for r in reqs:
        need[r.prompt] = max(need.get(r.prompt, 1), r.max_tokens if r.kind != "disconnect" else 1)
    out: dict[int, list[int]] = {}
    sem = asyncio.Semaphore(BASELINE_CONCURRENCY)

    async def one(k):
        async with sem:
            out[k] = await baseline_one(session, prompts[k], need[k], True)

    await asyncio.gather(*(one(k) for k in sorted(need)))
    return out


def expected(base: dict[int, list[int]], r: Req) -> list[int] | None:
    """The greedy output for r: a prefix of the prompt's baseline, cut after
    the first EOS when r stops there. None when the baseline is too short
    (a dropped stream that completed anyway): ask the baseline directly."""
    ids = base[r.prompt]
    if not r.ignore_eos and EOS_ID in ids:
        return ids[: ids.index(EOS_ID) + 1][: r.max_tokens]
    if len(ids) < r.max_tokens:
        return None
    return ids[: r.max_tokens]


# ---------------------------------------------------------------- metrics


def scrape(side: str) -> dict:
    """One side: "g" gonixl's gauges and counters (summed over its processes;
    None when no process exports one) and vLLM's; "proc" goroutines and RSS
    of each engine process that serves gonixl metrics."""
    cfg = SIDES[side]
    texts = {role: metrics(url.removesuffix("/metrics")) for role, url in cfg["procs"].items()}
    v = metrics(cfg["vllm"])
    g: dict[str, float | None] = {}
    for name in LIVE_GAUGES + ZERO_COUNTERS + INFO:
        vals = [x for t in texts.values() for x in samples(t, name)]
        g[name] = sum(vals) if vals else None
    for name in VLLM_ZERO:
        vals = samples(v, name)
        g[name] = sum(vals) if vals else None
    g["vllm_finished"] = sum(samples(v, "vllm:request_success_total"))
    g["prompt_tokens_external"] = sum(samples(v, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"))
    g["prompt_tokens_local"] = sum(samples(v, "vllm:prompt_tokens_by_source_total", source="local_compute"))
    proc = {}
    for role, t in texts.items():
        proc[role] = {}
        for name in PROC + PROC_INFO:
            vals = samples(t, name)
            proc[role][name] = vals[0] if vals else None
    return {"g": g, "proc": proc}


async def scrape_all() -> dict:
    return {s: await asyncio.to_thread(scrape, s) for s in SIDES}


def not_at_rest(snaps: dict) -> list[str]:
    bad = []
    for side, s in snaps.items():
        for name in LIVE_GAUGES + ZERO_COUNTERS + VLLM_ZERO:
            v = s["g"].get(name)
            if v != 0:
                bad.append(f"{side} {name}={'NOT EXPORTED' if v is None else f'{v:g}'}")
    return bad


async def sampler(peaks: dict, series: list, stop: asyncio.Event) -> None:
    """Peak goroutines, RSS and live gauges under load, and RSS over time
    (reported, not asserted)."""
    t0 = time.monotonic()
    while not stop.is_set():
        try:
            snaps = await scrape_all()
            series.append({"t": round(time.monotonic() - t0, 1), **{
                f"{side}:{role}:{k}": round(p[k] / MIB, 1)
                for side, s in snaps.items() for role, p in s["proc"].items()
                for k in ("process_resident_memory_bytes", "go_memstats_heap_inuse_bytes") if p.get(k)}})
            for side, s in snaps.items():
                for role, p in s["proc"].items():
                    for k, v in p.items():
                        if v is not None:
                            key = f"{role}:{k}"
                            peaks[side][key] = max(peaks[side].get(key, 0), v)
                for k in ["gonixl_live_transfer_handles", "gonixl_held_leases", "gonixl_receiving_requests",
                          "gonixl_scheduler_awaiting_kv", "gonixl_scheduler_send_pending", "gonixl_scheduler_heartbeat_leases"]:
                    if s["g"].get(k) is not None:
                        peaks[side][k] = max(peaks[side].get(k, 0), s["g"][k])
        except OSError as e:
            say(f"sampler: {e}")
        try:
            await asyncio.wait_for(stop.wait(), timeout=1)
        except TimeoutError:
            pass


# ---------------------------------------------------------------- main


def pct(v: list[float], p: float) -> float:
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]


LOG_PATTERNS = {
    "panic": r"\bpanic\b",
    "Traceback": r"Traceback \(most recent call last\)",
    "ERROR": r"\bERROR\b",
    "expired KV blocks released": r"Releasing expired KV blocks",
    "kv_lease_expired": r"kv_lease_expired",
    "transfer failed": r"NIXL transfer failure|transfer failed",
    "stuck handle": r"[Ss]tuck",
    "metrics server not started": r"metrics server not started",
}


def log_counts(text: str) -> dict[str, int]:
    return {k: len(re.findall(p, text)) for k, p in LOG_PATTERNS.items()}


def aborted_ids(text: str) -> set[int]:
    """Soak request numbers that vLLM logged as aborted (--enable-log-requests)."""
    out = set()
    for m in re.finditer(r"Aborted request\(s\) (.*)", text):
        out.update(int(x) for x in re.findall(rf"soak-{RUN_ID}-(\d+)", m.group(1)))
    return out


def discover() -> list[str]:
    """Fill SIDES[*]["procs"] from the logs; problems as failure lines."""
    bad = []
    for side, cfg in SIDES.items():
        log = read_from(cfg["log"])
        served = gonixl_metrics_urls(log)
        cfg["procs"] = {role: url for role, url in served}
        want = cfg["gonixl"] + "/metrics"
        if cfg["procs"].get("worker") != want or len(cfg["procs"]) != len(served):
            bad.append(f"{side}: 'gonixl metrics served' lines {served}, want the worker's at {want}")
        for line in re.findall(r".*metrics server not started.*", log):
            bad.append(f"{side}: {line.strip()}")
    return bad


async def main() -> int:
    failures: list[str] = []
    t_start = time.monotonic()
    # The metrics servers the engines announced. Where vLLM runs the worker
    # in the scheduler's process (the uni executor; TP = PP = 1) one server
    # on exactly GONIXL_METRICS_PORT has both; a scheduler in a process of
    # its own announces its own.
    failures += discover()
    for f in failures:
        say("problem:", f)

    prompts, reqs = make_plan(N_REQUESTS, SEED)
    n_warm = max(int(len(reqs) * WARMUP_FRAC), min(WARMUP_MIN, len(reqs) // 2), 1)
    say(
        f"{len(reqs)} requests ({n_warm} warm-up), concurrency {CONCURRENCY}, {len(prompts)} distinct prompts "
        f"(1..{max(len(p) for p in prompts)} tokens), deadline {DEADLINE_S:.0f}s, lease {LEASE_S:.0f}s, settle {SETTLE_S:.0f}s; "
        "kinds: " + ", ".join(f"{k} {sum(r.kind == k for r in reqs)}" for k in ("normal", "disconnect", "abort"))
        + f"; streamed {sum(r.stream for r in reqs)}; metrics "
        + "; ".join(f"{side} {cfg['procs']}" for side, cfg in SIDES.items())
    )
    idle0 = await scrape_all()
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request: a cancel closes it
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()
        base = await baseline(session, prompts, reqs)
        t_base = time.monotonic() - t0
        say(f"baseline: {len(base)} prompts in {t_base:.1f}s")

        lat = Latencies()
        t0 = time.monotonic()
        results = await run_load(session, prompts, reqs[:n_warm], lat, "warm-up")
        t_warm = time.monotonic() - t0
        say(f"warm-up: {len(results)} requests in {t_warm:.1f}s; settling {SETTLE_S:.0f}s")
        await asyncio.sleep(SETTLE_S)
        warm = await scrape_all()
        warm_busy = not_at_rest(warm)
        if warm_busy:
            say("warm-up: not at rest after settling (asserted at the end only):", "; ".join(warm_busy))

        peaks: dict[str, dict] = {s: {} for s in SIDES}
        series: list[dict] = []
        stop = asyncio.Event()
        samp = asyncio.create_task(sampler(peaks, series, stop))
        t0 = time.monotonic()
        results += await run_load(session, prompts, reqs[n_warm:], lat, "load")
        t_load = time.monotonic() - t0
        stop.set()
        await samp
    say(f"load: {len(reqs) - n_warm} requests in {t_load:.1f}s; settling {SETTLE_S:.0f}s")
    t_end_load = time.monotonic()
    await asyncio.sleep(SETTLE_S)
    end = await scrape_all()
    busy = not_at_rest(end)
    cleared_after = None
    if any("NOT EXPORTED" not in b for b in busy):
        # Diagnostics only (the check already failed): does it clear later?
        for _ in range(30):
            await asyncio.sleep(2)
            if all("NOT EXPORTED" in b for b in not_at_rest(await scrape_all())):
                cleared_after = time.monotonic() - t_end_load
                break

    # ---- checks
    by = {k: [r for r in results if r.outcome == k] for k in ("completed", "disconnected", "aborted", "error", "hung")}
    wrong = []
    direct = 0  # expectations asked from the baseline directly (derivation not possible or not matching)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        for r in by["completed"]:
            want = expected(base, r.req)
            if r.token_ids != want:
                # Before calling it wrong, ask the baseline the very same request
                # (rules out a fault in deriving the expectation).
                direct += 1
                want = await baseline_one(session, prompts[r.req.prompt], r.req.max_tokens, r.req.ignore_eos)
            r.verdict = "correct" if r.token_ids == want else "wrong"
            if r.verdict == "wrong":
                wrong.append((r, want))
    for r, want in wrong[:20]:
        q = r.req
        say(
            f"WRONG request {q.i} (soak-{RUN_ID}-{q.i}): prompt #{q.prompt} len {len(prompts[q.prompt])} max_tokens {q.max_tokens} "
            f"ignore_eos {q.ignore_eos} stream {q.stream} kind {q.kind}: got {r.token_ids} ({r.text!r}), baseline {want}"
        )
    if wrong:
        failures.append(f"{len(wrong)} completed responses differ from the baseline")
    for r in (by["hung"] + by["error"])[:20]:
        say(f"{r.outcome.upper()} request {r.req.i} (soak-{RUN_ID}-{r.req.i}, {r.req.kind}, stream {r.req.stream}): "
            f"HTTP {r.status} {r.detail}")
    if by["hung"]:
        failures.append(f"{len(by['hung'])} requests hung past the {DEADLINE_S:.0f}s deadline")
    if by["error"]:
        failures.append(f"{len(by['error'])} requests failed")
    if busy:
        failures.append(
            f"not at rest {SETTLE_S:.0f}s after the load: " + "; ".join(busy)
            + (f" (cleared {cleared_after:.0f}s after the load)" if cleared_after
               else "" if all("NOT EXPORTED" in b for b in busy) else " (still not after a further 60s)")
        )
    for side in SIDES:
        for role in SIDES[side]["procs"]:
            w, e = warm[side]["proc"].get(role, {}), end[side]["proc"].get(role, {})
            gw, ge = w.get("go_goroutines"), e.get("go_goroutines")
            rw, re_ = w.get("process_resident_memory_bytes"), e.get("process_resident_memory_bytes")
            if None in (gw, ge, rw, re_):
                failures.append(f"{side} {role}: go_goroutines / process_resident_memory_bytes not exported")
                continue
            if ge > gw + GOROUTINE_MARGIN:
                failures.append(f"{side} {role}: goroutines {gw:.0f} after warm-up, {ge:.0f} at the end (margin {GOROUTINE_MARGIN})")
            hw, he = w.get("go_memstats_heap_inuse_bytes"), e.get("go_memstats_heap_inuse_bytes")
            if hw is not None and he is not None and he - hw > GO_HEAP_MARGIN_MIB * MIB:
                failures.append(f"{side} {role}: Go heap in use grew {(he - hw) / MIB:.1f} MiB after warm-up (allowed {GO_HEAP_MARGIN_MIB:g} MiB)")
            allow = max(RSS_MARGIN_MIB * MIB, RSS_MARGIN_PCT / 100 * rw)
            if re_ - rw > allow:
                failures.append(f"{side} {role}: RSS grew {(re_ - rw) / MIB:.1f} MiB after warm-up (allowed {allow / MIB:.1f} MiB)")
    pulled = end["decode"]["g"]["prompt_tokens_external"] - idle0["decode"]["g"]["prompt_tokens_external"]
    if pulled <= 0:
        failures.append("the decode pulled no prompt token over gonixl (vllm:prompt_tokens_by_source_total external_kv_transfer)")
    ptext = metrics(PROXY)
    proxy_errors = {}
    for line in ptext.splitlines():
        m = re.match(r'gonixl_proxy_errors_total\{(.*)\} (\S+)', line)
        if m and float(m.group(2)):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            proxy_errors[f"{labels.get('role')}/{labels.get('reason')}"] = float(m.group(2))
    texts = {side: read_from(SIDES[side]["log"]) for side in SIDES}
    logs = {side: log_counts(texts[side]) for side in SIDES}
    for side in SIDES:
        if logs[side]["panic"]:
            failures.append(f"{side} log mentions panic {logs[side]['panic']} times")
    # The decode recomputes a request whose load failed (run_soak_test.sh's
    # kv_load_failure_policy recompute): a lapsed lease is a timing outcome
    # of a starved machine, counted here; any other kind of failed load is
    # one the soak must not pass over.
    kinds = collections.Counter(re.findall(r"NIXL transfer failure: (\w+)", texts["decode"]))
    other = {k: n for k, n in kinds.items() if k != "kv_lease_expired"}
    if other:
        failures.append(f"decode log: transfer failures other than a lapsed lease: {other}")
    say(f"decode log: {kinds.get('kv_lease_expired', 0)} loads refused for a lapsed lease (recomputed); other failures {other or 'none'}")
    # Where did the client's aborts and disconnects land? vLLM logs each
    # request it aborts (--enable-log-requests). "not aborted by vLLM": the
    # client left before the proxy sent the prefill, between prefill and
    # decode (the prefill's lease then holds the blocks until it ends), or
    # after vLLM had finished.
    ab = {side: aborted_ids(texts[side]) for side in SIDES}
    stages: dict[str, dict[str, int]] = {}
    for kind in ("aborted", "disconnected"):
        st = {"prefill": 0, "decode": 0, "not aborted by vLLM": 0}
        for r in by[kind]:
            if r.req.i in ab["prefill"]:
                st["prefill"] += 1
            elif r.req.i in ab["decode"]:
                st["decode"] += 1
            else:
                st["not aborted by vLLM"] += 1
        stages[kind] = st

    # ---- summary
    lats = [r.latency for r in by["completed"]]
    summary = {
        "run_id": RUN_ID,
        "requests": len(results),
        "concurrency": CONCURRENCY,
        "outcomes": {k: len(v) for k, v in by.items()},
        "aborts_that_came_too_late": sum(1 for r in by["completed"] if r.req.kind == "abort"),
        "abort_stages": stages,
        "vllm_logged_aborts": {side: len(ab[side]) for side in SIDES},
        "proxy_errors": proxy_errors,
        "correct": sum(1 for r in by["completed"] if r.verdict == "correct"),
        "wrong": len(wrong),
        "expectations_asked_directly": direct,
        "latency_p50_s": round(pct(lats, 50), 3),
        "latency_p99_s": round(pct(lats, 99), 3),
        "latency_max_s": round(max(lats), 3) if lats else None,
        "baseline_s": round(t_base, 1),
        "warmup_s": round(t_warm, 1),
        "load_s": round(t_load, 1),
        "total_s": round(time.monotonic() - t_start, 1),
        "deadline_s": DEADLINE_S,
        "lease_s": LEASE_S,
        "settle_s": SETTLE_S,
        "decode_prompt_tokens": {
            "external_kv_transfer": pulled,
            "local_compute": end["decode"]["g"]["prompt_tokens_local"] - idle0["decode"]["g"]["prompt_tokens_local"],
        },
        "sides": {
            side: {
                "procs": SIDES[side]["procs"],
                "idle_before": idle0[side]["proc"],
                "post_warmup": warm[side]["proc"],
                "peak_under_load": peaks[side],
                "end": end[side]["proc"],
                "live_post_warmup": {k: warm[side]["g"].get(k) for k in LIVE_GAUGES + ZERO_COUNTERS + VLLM_ZERO},
                "live_at_end": {k: end[side]["g"].get(k) for k in LIVE_GAUGES + ZERO_COUNTERS + VLLM_ZERO},
                "info_at_end": {k: end[side]["g"].get(k) for k in INFO},
                "vllm_finished": end[side]["g"]["vllm_finished"] - idle0[side]["g"]["vllm_finished"],
                "log": logs[side],
            }
            for side in SIDES
        },
        "rss_series": series,
        "failures": failures,
    }
    o = summary["outcomes"]

    def num(x):
        return "MISSING" if x is None else f"{x:g}"

    def mib(x):
        return "?" if x is None else f"{x / MIB:.1f}MiB"

    print("\n==== soak summary ====")
    print(f"requests {summary['requests']} at concurrency {CONCURRENCY}: completed {o['completed']} "
          f"(of them {summary['aborts_that_came_too_late']} aborts that came too late), disconnected {o['disconnected']}, "
          f"aborted {o['aborted']}, errors {o['error']}, hung {o['hung']}")
    print(f"where vLLM aborted them: {stages}; proxy errors by role/reason: {proxy_errors}")
    print(f"correct {summary['correct']}, wrong {summary['wrong']} (token-exact against the aggregated baseline; "
          f"{direct} expectations asked from it directly)")
    print(f"latency of completed: p50 {summary['latency_p50_s']}s, p99 {summary['latency_p99_s']}s, max {summary['latency_max_s']}s "
          f"(deadline {DEADLINE_S:.0f}s)")
    print(f"durations: baseline {t_base:.1f}s, warm-up {t_warm:.1f}s, load {t_load:.1f}s, settle {SETTLE_S:.0f}s x2, "
          f"soak.py total {summary['total_s']}s")
    print(f"decode prompt tokens: pulled over gonixl {pulled:.0f}, computed locally {summary['decode_prompt_tokens']['local_compute']:.0f}")
    for side in SIDES:
        s = summary["sides"][side]
        for role in s["procs"]:
            i, w, e, pk = s["idle_before"].get(role, {}), s["post_warmup"].get(role, {}), s["end"].get(role, {}), s["peak_under_load"]
            print(f"{side} engine process (metrics server of the {role}): goroutines idle {num(i.get('go_goroutines'))} -> post-warm-up {num(w.get('go_goroutines'))} "
                  f"-> peak {num(pk.get(role + ':go_goroutines'))} -> end {num(e.get('go_goroutines'))}; "
                  f"RSS idle {mib(i.get('process_resident_memory_bytes'))} -> post-warm-up {mib(w.get('process_resident_memory_bytes'))} "
                  f"-> peak {mib(pk.get(role + ':process_resident_memory_bytes'))} -> end {mib(e.get('process_resident_memory_bytes'))}; "
                  f"Go heap in use post-warm-up {mib(w.get('go_memstats_heap_inuse_bytes'))} -> end {mib(e.get('go_memstats_heap_inuse_bytes'))}, "
                  f"Go sys {mib(w.get('go_memstats_sys_bytes'))} -> {mib(e.get('go_memstats_sys_bytes'))}")
        print(f"{side}: at end " + ", ".join(f"{k.removeprefix('gonixl_')}={num(v)}" for k, v in s["live_at_end"].items()))
        print(f"{side}: peaks under load " + ", ".join(f"{k.removeprefix('gonixl_')}={num(v)}" for k, v in pk.items() if ":" not in k))
        print(f"{side}: " + ", ".join(f"{k.removeprefix('gonixl_')}={num(v)}" for k, v in s["info_at_end"].items())
              + f"; vLLM finished {s['vllm_finished']:.0f}, logged aborts {summary['vllm_logged_aborts'][side]}; log {s['log']}")
    if SUMMARY_PATH:
        with open(SUMMARY_PATH, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    if failures:
        print("\nSOAK FAILED:")
        for f in failures:
            print("  -", f)
        return 1
    print("\nSOAK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
