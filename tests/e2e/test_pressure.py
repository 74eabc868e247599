"""KV-cache pressure and preemption, end to end, with async scheduling on.

Started by run_pressure_test.sh once per configuration MODE:PREFILL-DECODE
(pull or push; each side gonixl "go" or vLLM's stock connector "stock"): a
prefill and a decode vLLM whose KV pools are small enough that both preempt
(--num-gpu-blocks-override), chunked prefill on the prefill
(--max-num-batched-tokens well below the prompt lengths), gonixl-proxy in
front (--push in push mode), and the aggregated baseline, every instance with
async scheduling kept on by tests/vllm_async_plugin
(GONIXL_TEST_ASYNC_SCHEDULING=1).

First one request through the proxy while the machine is quiet, so that the
instances handshake before the load, not under it: vLLM's stock connector
gives its handshake a fixed 5 s, which a starved 2-core host can miss
(requests then fail with HTTP 500; gonixl's handshake_timeout is 30 s). Its
output is checked like every other.

Load, in three phases, while other traffic (long outputs, no connector work)
goes straight at the prefill the whole time:

1. pressure: PRESSURE_REQUESTS requests through the proxy, CONCURRENCY at a
   time, prompts of 200-500 tokens (half of them in families that share a
   256-token prefix, so prefix-cache hits meet preemption), most with long
   outputs (ignore_eos, up to MAX_TOKENS), the rest stopping at EOS;
2. abandon: ABANDON requests at once whose clients give up after
   ABANDON_AFTER seconds (the proxy cancels them upstream);
3. fresh: after PAUSE seconds, the same prompts again, FRESH requests at
   once, new request ids.

Asserts, each a test below:

- every instance's log proves async scheduling: the plugin's line naming
  the AsyncScheduler and its count of steps scheduled before an earlier
  step's output was processed;
- every completed output equals the aggregated baseline's, token for token;
- every request that was not abandoned completed (HTTP 200) within
  DEADLINE seconds of being sent;
- vLLM's vllm:num_preemptions_total grew on the prefill and on the decode;
- once the load is over (waiting at most the lease plus SETTLE_MARGIN), every
  live gauge is zero: gonixl's (transfer handles, receiving requests, held
  leases, handshakes, the scheduler's awaiting-KV / send-pending / heartbeat
  leases) on each gonixl side, vLLM's KV-cache usage and running / waiting
  requests on both;
- neither log shows a panic, a Python traceback or a notification gonixl
  could not parse ("malformed notification").

Knobs (environment): GONIXL_PRESSURE_REQUESTS (24), GONIXL_PRESSURE_DIRECT
(requests straight at the prefill, 8), GONIXL_PRESSURE_DIRECT_CONCURRENCY (2),
GONIXL_PRESSURE_ABANDON (16),
GONIXL_PRESSURE_ABANDON_AFTER (0.2 s), GONIXL_PRESSURE_FRESH (16),
GONIXL_PRESSURE_PAUSE (0 s),
GONIXL_PRESSURE_CONCURRENCY (12), GONIXL_PRESSURE_MAX_TOKENS (256),
GONIXL_PRESSURE_DEADLINE (180 s), GONIXL_PRESSURE_SETTLE_MARGIN (30 s),
GONIXL_PRESSURE_SEED (2026). run_pressure_test.sh passes the topology in
GONIXL_PR_* variables.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import sys
import time

import aiohttp
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_common import gonixl_metrics_urls, metrics, model_task, read_from, record_retry, samples, where_time_went


def _env(name: str, default: str) -> str:
    v = os.environ.get(name, "")
    return v if v != "" else default


CONFIG = os.environ.get("GONIXL_PR_CONFIG", "")
PROXY = os.environ.get("GONIXL_PR_PROXY", "")
BASELINE = os.environ.get("GONIXL_PR_BASELINE", "")
MODEL = os.environ.get("GONIXL_PR_MODEL", "")
# name -> {"url", "log", "gonixl": bool}; names prefill, decode, baseline.
INSTANCES: dict[str, dict] = json.loads(os.environ.get("GONIXL_PR_INSTANCES") or "{}")
PROXY_LOG = os.environ.get("GONIXL_PR_PROXY_LOG", "")
LEASE_S = float(_env("GONIXL_PR_LEASE", "120"))
SUMMARY_PATH = os.environ.get("GONIXL_PR_SUMMARY", "")

PRESSURE_REQUESTS = int(_env("GONIXL_PRESSURE_REQUESTS", "24"))
DIRECT = int(_env("GONIXL_PRESSURE_DIRECT", "8"))
DIRECT_CONCURRENCY = int(_env("GONIXL_PRESSURE_DIRECT_CONCURRENCY", "2"))
ABANDON = int(_env("GONIXL_PRESSURE_ABANDON", "16"))
ABANDON_AFTER = float(_env("GONIXL_PRESSURE_ABANDON_AFTER", "0.2"))
FRESH = int(_env("GONIXL_PRESSURE_FRESH", "16"))
# Seconds between the abandon phase and the fresh one (the other traffic
# goes on meanwhile): past twice the lease, a decode that cancelled gives
# its blocks back without an answer from the prefill.
PAUSE_S = float(_env("GONIXL_PRESSURE_PAUSE", "0"))
CONCURRENCY = int(_env("GONIXL_PRESSURE_CONCURRENCY", "12"))
MAX_TOKENS = int(_env("GONIXL_PRESSURE_MAX_TOKENS", "256"))
DEADLINE_S = float(_env("GONIXL_PRESSURE_DEADLINE", "180"))
SETTLE_S = LEASE_S + float(_env("GONIXL_PRESSURE_SETTLE_MARGIN", "30"))
SEED = int(_env("GONIXL_PRESSURE_SEED", "2026"))

# The plugin's lines (tests/vllm_async_plugin/gonixl_async_plugin).
ASYNC_ON = re.compile(r"gonixl-test: async scheduling on: AsyncScheduler, batch queue (\d+)")
ASYNC_OVERLAP = re.compile(r"gonixl-test: async scheduling: (\d+) steps scheduled before an earlier step's output was processed")
PREEMPTIONS = "vllm:num_preemptions_total"
DEFERRED = "gonixl_scheduler_preemptions_deferred_total"
GONIXL_GAUGES = [
    "gonixl_live_transfer_handles",
    "gonixl_stuck_transfer_handles",
    "gonixl_receiving_requests",
    "gonixl_held_leases",
    "gonixl_pending_handshakes",
    "gonixl_scheduler_awaiting_kv",
    "gonixl_scheduler_send_pending",
    "gonixl_scheduler_heartbeat_leases",
]
VLLM_GAUGES = ["vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"]
LOG_PROBLEMS = {
    "panic": re.compile(r"\bpanic\b"),
    "Traceback": re.compile(r"Traceback \(most recent call last\)"),
    "malformed notification": re.compile(r"malformed notification"),
}
# Reported, not failures: where a request's time or KV went.
LOG_NOTES = {
    "transfer failure": re.compile(r"NIXL transfer failure"),
    "expired KV released": re.compile(r"Releasing expired KV blocks"),
    "push timeout": re.compile(r"push_registration_timeout"),
    "push held": re.compile(r"push: "),
    "kv load failed": re.compile(r"[Ff]ailed to load KV|kv_load_failure|recompute"),
}
EOS_ID = 2
RUN_ID = "%06x" % random.randrange(1 << 24)

pytestmark = pytest.mark.skipif(
    not (PROXY and BASELINE and INSTANCES), reason="run through tests/e2e/run_pressure_test.sh (it starts the servers)"
)


def say(*a) -> None:
    print(f"pressure[{CONFIG}]:", *a, flush=True)


@dataclasses.dataclass
class Req:
    rid: str
    phase: str  # warm | pressure | abandon | fresh | direct
    prompt: str
    max_tokens: int
    ignore_eos: bool


@dataclasses.dataclass
class Result:
    req: Req
    outcome: str = "error"  # completed | abandoned | error | hung
    status: int = 0
    token_ids: list[int] | None = None
    detail: str = ""
    started: float = 0.0  # wall clock
    latency: float = 0.0
    verdict: str = ""  # correct | wrong (completed only)


def make_plan(seed: int, run_id: str) -> list[Req]:
    rng = random.Random(seed)
    prefixes = ["".join(rng.choice(model_task.FILLER_CHARS) for _ in range(256)) for _ in range(4)]

    def prompt() -> str:
        if rng.random() < 0.5:  # a family member: 256 shared tokens + 44..244 of its own
            return rng.choice(prefixes) + model_task.make_example(rng, rng.randint(44, 244)).prompt
        return model_task.make_example(rng, rng.randint(200, 500)).prompt

    def limits() -> tuple[int, bool]:
        if rng.random() < 0.7:
            return rng.randint(MAX_TOKENS // 2, MAX_TOKENS), True
        return model_task.MAX_KEY_LEN + 2, False

    warm = model_task.make_example(random.Random(seed + 1), 64).prompt
    plan = [Req(f"pr-{run_id}-w0", "warm", warm, 4, True)]
    plan += [Req(f"pr-{run_id}-p{i}", "pressure", prompt(), *limits()) for i in range(PRESSURE_REQUESTS)]
    plan += [Req(f"pr-{run_id}-d{i}", "direct", prompt(), MAX_TOKENS, True) for i in range(DIRECT)]
    abandoned = [Req(f"pr-{run_id}-a{i}", "abandon", prompt(), *limits()) for i in range(ABANDON)]
    plan += abandoned
    # The fresh requests: clients coming back with the abandoned prompts
    # (and more, when FRESH > ABANDON), under new request ids.
    for i in range(FRESH):
        if i < len(abandoned):
            a = abandoned[i]
            plan.append(Req(f"pr-{run_id}-f{i}", "fresh", a.prompt, a.max_tokens, a.ignore_eos))
        else:
            plan.append(Req(f"pr-{run_id}-f{i}", "fresh", prompt(), *limits()))
    return plan


def body_of(r: Req) -> dict:
    return {
        "model": MODEL,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "seed": 0,
        "ignore_eos": r.ignore_eos,
        "return_token_ids": True,
    }


async def send(session: aiohttp.ClientSession, url: str, r: Req, res: Result) -> None:
    async with session.post(url + "/v1/completions", json=body_of(r), headers={"X-Request-Id": r.rid}) as resp:
        res.status = resp.status
        if resp.status != 200:
            res.outcome, res.detail = "error", (await resp.text())[:300]
            return
        data = await resp.json(content_type=None)
        res.token_ids = list(data["choices"][0].get("token_ids") or [])
        res.outcome = "completed"


async def run_one(session: aiohttp.ClientSession, url: str, r: Req, give_up: float | None = None) -> Result:
    res = Result(r, started=time.time())
    t0 = time.monotonic()
    try:
        if give_up is not None:
            task = asyncio.create_task(send(session, url, r, res))
            done, _ = await asyncio.wait({task}, timeout=give_up)
            if task in done:
                task.result()
                res.detail = "answered before the client gave up"
            else:
                task.cancel()  # closes the connection: the proxy cancels upstream
                await asyncio.gather(task, return_exceptions=True)
                res.outcome = "abandoned"
        else:
            async with asyncio.timeout(DEADLINE_S):
                await send(session, url, r, res)
    except TimeoutError:
        res.outcome, res.detail = "hung", f"no complete response within {DEADLINE_S:.0f}s"
    except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError, KeyError, IndexError) as e:
        res.outcome, res.detail = "error", f"{type(e).__name__}: {e}"[:300]
    res.latency = time.monotonic() - t0
    return res


async def run_many(session, url: str, reqs: list[Req], concurrency: int, give_up: float | None = None) -> list[Result]:
    sem = asyncio.Semaphore(concurrency)

    async def one(r: Req) -> Result:
        async with sem:
            return await run_one(session, url, r, give_up)

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def baseline(session, reqs: list[Req], run_id: str) -> dict[str, list[int]]:
    """Greedy token ids per distinct prompt, EOS ignored, at the largest
    max_tokens asked for it; every expectation is a prefix (expected())."""
    need: dict[str, int] = {}
    for r in reqs:
        need[r.prompt] = max(need.get(r.prompt, 1), r.max_tokens)
    out: dict[str, list[int]] = {}
    sem = asyncio.Semaphore(8)

    async def one(i: int, prompt: str) -> None:
        async with sem:
            res = await run_one(session, BASELINE, Req(f"pr-{run_id}-b{i}", "baseline", prompt, need[prompt], True))
        if res.outcome != "completed" or res.token_ids is None:
            raise RuntimeError(f"baseline failed: {res.outcome} HTTP {res.status} {res.detail}")
        out[prompt] = res.token_ids

    await asyncio.gather(*(one(i, p) for i, p in enumerate(need)))
    return out


def expected(base: dict[str, list[int]], r: Req) -> list[int]:
    ids = base[r.prompt]
    if not r.ignore_eos and EOS_ID in ids:
        return ids[: ids.index(EOS_ID) + 1][: r.max_tokens]
    return ids[: r.max_tokens]


def gonixl_procs(name: str) -> dict[str, str]:
    """role -> metrics URL of each gonixl engine process of instance name."""
    inst = INSTANCES[name]
    if not inst.get("gonixl"):
        return {}
    return dict(gonixl_metrics_urls(read_from(inst["log"])))


def live_values(name: str) -> dict[str, float | None]:
    """The live gauges of instance name (None: not exported)."""
    inst = INSTANCES[name]
    out: dict[str, float | None] = {}
    v = metrics(inst["url"])
    for g in VLLM_GAUGES:
        vals = samples(v, g)
        out[g] = sum(vals) if vals else None
    if inst.get("gonixl"):
        texts = [metrics(u.removesuffix("/metrics")) for u in gonixl_procs(name).values()]
        for g in GONIXL_GAUGES:
            vals = [x for t in texts for x in samples(t, g)]
            out[g] = sum(vals) if vals else None
    return out


def not_at_rest() -> list[str]:
    bad = []
    for name in ("prefill", "decode"):
        for g, v in live_values(name).items():
            if v != 0:
                bad.append(f"{name} {g}={'NOT EXPORTED' if v is None else f'{v:g}'}")
    return bad


def preemptions(name: str) -> float:
    return sum(samples(metrics(INSTANCES[name]["url"]), PREEMPTIONS))


def deferred(name: str) -> float:
    """Times a push prefill's vLLM was about to preempt for room and waited
    a step instead (has_pending_block_frees, for a prompt announced for its
    early WRITE): gonixl's counter, 0 where gonixl does not serve it."""
    if not INSTANCES[name].get("gonixl"):
        return 0.0
    return sum(x for u in gonixl_procs(name).values() for x in samples(metrics(u.removesuffix("/metrics")), DEFERRED))


@dataclasses.dataclass
class Run:
    results: list[Result]
    base: dict[str, list[int]]
    preempted: dict[str, float]
    deferred: dict[str, float]
    rest: list[str]
    rest_after: float
    offsets: dict[str, int]
    wall: dict[str, float]


async def _run(seed: int, run_id: str) -> Run:
    plan = make_plan(seed, run_id)
    offsets = {n: os.path.getsize(i["log"]) for n, i in INSTANCES.items() if n != "baseline"}
    pre0 = {n: preemptions(n) for n in ("prefill", "decode")}
    def0 = {n: deferred(n) for n in ("prefill", "decode")}
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request: a cancel closes it
    wall: dict[str, float] = {}
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()
        base = await baseline(session, plan, run_id)
        wall["baseline"] = time.monotonic() - t0
        say(f"baseline: {len(base)} prompts in {wall['baseline']:.1f}s")
        by = {p: [r for r in plan if r.phase == p] for p in ("warm", "pressure", "direct", "abandon", "fresh")}
        t0 = time.monotonic()
        results = await run_many(session, PROXY, by["warm"], 1)
        say(f"warm-up: {results[0].outcome} in {time.monotonic() - t0:.1f}s")
        t0 = time.monotonic()
        direct = asyncio.create_task(run_many(session, INSTANCES["prefill"]["url"], by["direct"], DIRECT_CONCURRENCY))
        results += await run_many(session, PROXY, by["pressure"], CONCURRENCY)
        wall["pressure"] = time.monotonic() - t0
        say(f"pressure: {len(results)} requests in {wall['pressure']:.1f}s")
        t0 = time.monotonic()
        results += await run_many(session, PROXY, by["abandon"], len(by["abandon"]) or 1, give_up=ABANDON_AFTER)
        await asyncio.sleep(PAUSE_S)
        t1 = time.monotonic()
        results += await run_many(session, PROXY, by["fresh"], len(by["fresh"]) or 1)
        wall["fresh"] = time.monotonic() - t1
        say(f"abandon + fresh: {len(by['abandon'])} + {len(by['fresh'])} requests in {time.monotonic() - t0:.1f}s")
        results += await direct
    # At rest: the first moment every live gauge is zero, within SETTLE_S.
    t_end = time.monotonic()
    rest = not_at_rest()
    while rest and time.monotonic() - t_end < SETTLE_S:
        await asyncio.sleep(2)
        rest = await asyncio.to_thread(not_at_rest)
    rest_after = time.monotonic() - t_end
    pre = {n: preemptions(n) - pre0[n] for n in ("prefill", "decode")}
    dfr = {n: deferred(n) - def0[n] for n in ("prefill", "decode")}
    # Mismatches are asked again from the baseline directly (rules out a
    # fault in deriving the expectation).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        for r in results:
            if r.outcome != "completed":
                continue
            want = expected(base, r.req)
            if r.token_ids != want:
                res = await run_one(session, BASELINE, r.req)
                want = res.token_ids if res.outcome == "completed" else want
            r.verdict = "correct" if r.token_ids == want else "wrong"
    return Run(results, base, pre, dfr, rest, rest_after, offsets, wall)


def _pressed(r: Run) -> bool:
    """Both KV pools ran out: preempted, or (a push prefill) about to."""
    return all(r.preempted[n] > 0 or r.deferred[n] > 0 for n in ("prefill", "decode"))


@pytest.fixture(scope="module")
def run() -> Run:
    r = asyncio.run(_run(SEED, RUN_ID))
    if not _pressed(r):
        # Whether the load runs a pool out depends on how the prefill's
        # direct requests overlap the P/D prompts (push admission also
        # holds prompts back until their decode registered): seen once in
        # CI, a push prefill with 0 preemptions. Once more with other
        # prompts, counted (./build.sh test allows one, tests/declared.toml);
        # the first load's outputs are judged as well.
        record_retry(f"pressure load {CONFIG}", f"no KV pool ran out: preemptions {r.preempted}, deferred {r.deferred}")
        r2 = asyncio.run(_run(SEED + 1, RUN_ID + "r"))
        r = Run(
            results=r.results + r2.results,
            base={**r.base, **r2.base},
            preempted={n: r.preempted[n] + r2.preempted[n] for n in r.preempted},
            deferred={n: r.deferred[n] + r2.deferred[n] for n in r.deferred},
            rest=r2.rest,
            rest_after=r2.rest_after,
            offsets=r.offsets,
            wall=r2.wall,
        )
    by: dict[str, int] = {}
    for x in r.results:
        k = f"{x.req.phase}/{x.outcome}" + (f"/{x.verdict}" if x.verdict else "")
        by[k] = by.get(k, 0) + 1
    lat = sorted(x.latency for x in r.results if x.outcome == "completed")
    texts = {n: read_from(INSTANCES[n]["log"], off) for n, off in r.offsets.items()}
    notes = {n: {k: len(p.findall(t)) for k, p in LOG_NOTES.items()} for n, t in texts.items()}
    summary = {
        "config": CONFIG,
        "outcomes": dict(sorted(by.items())),
        "latency_max_s": round(lat[-1], 1) if lat else None,
        "preemptions": r.preempted,
        "preemptions_deferred": r.deferred,
        "at_rest_after_s": round(r.rest_after, 1),
        "not_at_rest": r.rest,
        "phases_s": {k: round(v, 1) for k, v in r.wall.items()},
        "log_notes": notes,
    }
    say("summary " + json.dumps(summary))
    if SUMMARY_PATH:
        with open(SUMMARY_PATH, "a") as f:
            f.write(json.dumps(summary) + "\n")
    return r


def test_async_scheduling_on_in_every_instance(run):
    for name, inst in INSTANCES.items():
        if name == "baseline" and not inst["log"]:
            continue  # ./build.sh test's shared baseline: its outputs do not depend on the scheduling
        text = read_from(inst["log"])
        on = ASYNC_ON.findall(text)
        assert on, f"{name}: no line '{ASYNC_ON.pattern}' in {inst['log']} (plugin installed, GONIXL_TEST_ASYNC_SCHEDULING=1?)"
        assert all(int(n) >= 2 for n in on), f"{name}: batch queue {on}"
        overlaps = [int(n) for n in ASYNC_OVERLAP.findall(text)]
        assert overlaps, f"{name}: the scheduler never scheduled a step before an earlier one's output was processed"
        say(f"{name}: AsyncScheduler, at least {max(overlaps)} overlapping steps")


def test_outputs_equal_baseline(run):
    wrong = [r for r in run.results if r.verdict == "wrong"]
    for r in wrong[:10]:
        want = expected(run.base, r.req)
        got = r.token_ids or []
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        say(f"WRONG {r.req.rid} ({r.req.phase}, prompt {len(r.req.prompt)} chars, max_tokens {r.req.max_tokens}, "
            f"ignore_eos {r.req.ignore_eos}): first difference at output token {first}: got {got[first:first + 8]}, "
            f"baseline {want[first:first + 8]}")
    assert not wrong, f"{len(wrong)} completed outputs differ from the aggregated baseline: {[r.req.rid for r in wrong]}"
    assert any(r.verdict == "correct" and r.req.phase != "direct" for r in run.results), "no request through the proxy completed"


def test_every_request_ended_within_its_bound(run):
    bad = [r for r in run.results if r.req.phase != "abandon" and r.outcome != "completed"]
    logs = {n: i["log"] for n, i in INSTANCES.items() if n != "baseline"}
    for r in bad[:10]:
        say(f"{r.outcome.upper()} {r.req.rid} ({r.req.phase}): HTTP {r.status} {r.detail}")
        if r.req.phase != "direct":
            say(where_time_went(r.req.rid, r.started, r.latency, PROXY_LOG, logs))
    assert not bad, f"{len(bad)} requests did not complete within {DEADLINE_S:.0f}s: " + ", ".join(
        f"{r.req.rid} {r.outcome}" for r in bad)


def test_both_instances_preempted(run):
    """The load ran both KV pools out: vLLM preempted, or (a push prefill
    only) was about to and waited a step because a prompt announced for its
    early WRITE was not finished — gonixl's answer to has_pending_block_frees,
    which vLLM asks only where it would preempt (issue 30's ownership rule:
    no early WRITE reads blocks a preemption freed)."""
    for name in ("prefill", "decode"):
        assert run.preempted[name] > 0 or run.deferred[name] > 0, (
            f"{name}: neither {PREEMPTIONS} nor {DEFERRED} grew: the load did not preempt (pool too large?)"
        )


def test_every_live_gauge_zero_at_rest(run):
    assert not run.rest, f"not at rest {SETTLE_S:.0f}s after the load: " + "; ".join(run.rest)


def test_no_panic_traceback_or_malformed_notification(run):
    problems = []
    for name, off in run.offsets.items():
        text = read_from(INSTANCES[name]["log"], off)
        for what, pat in LOG_PROBLEMS.items():
            hits = [ln for ln in text.splitlines() if pat.search(ln)]
            if hits:
                problems.append(f"{name}: {len(hits)} lines with {what!r}, first: {hits[0][:300]}")
    assert not problems, "; ".join(problems)
