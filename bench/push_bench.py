"""Client of ./build.sh bench-push (bench/run_push_bench.sh): TTFT and
hand-off time through gonixl-proxy for one deployment (pull or push,
gonixl's connector or vLLM's stock one).

For each prompt length and concurrency it sends fresh prompts (no prefix-cache
hit anywhere) as streamed completions through the proxy and records the time
to the first streamed token (TTFT) and to the end. The prefill's own time for
the same kind of prompt is measured alone first (fresh prompts of the same
length sent straight to the prefill, max_tokens 1): the hand-off is TTFT minus
that, i.e. everything between the prefill's answer and the decode's first
token (pull: the proxy's round trip, the decode's scheduling, the READ; push:
whatever of the WRITE and the decode's wait did not overlap the prefill).

Usage: push_bench.py --proxy URL --prefill URL --model PATH --label NAME
       --lengths 128,1000 --concurrency 1,8 --requests 16 --out FILE.json
Pure standard library (plus tests/fixtures/model_task.py for prompts).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
import model_task

_rng = random.Random(int(os.environ.get("GONIXL_BENCH_SEED", "7")))


def fresh(n: int) -> str:
    return model_task.make_example(_rng, n).prompt


def post(url: str, body: dict, stream: bool) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the end, prompt tokens)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    t0 = time.monotonic()
    first, prompt_tokens = None, 0
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            out = json.load(r)
            t = time.monotonic() - t0
            return t, t, out.get("usage", {}).get("prompt_tokens", 0)
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                first = time.monotonic() - t0
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
    end = time.monotonic() - t0
    return (first if first is not None else end), end, prompt_tokens


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--lengths", default="128,1000")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    body = {"model": a.model, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    # Warm-up: handshakes, first transfers.
    for _ in range(3):
        post(a.proxy, {**body, "prompt": fresh(64), "stream": True, "stream_options": {"include_usage": True}}, True)
    results = {"label": a.label, "cases": []}
    for n in lengths:
        alone = [post(a.prefill, {**body, "prompt": fresh(n), "max_tokens": 1}, False)[0] for _ in range(6)]
        p_med = statistics.median(alone)
        for c in concs:
            prompts = [fresh(n) for _ in range(a.requests)]
            with cf.ThreadPoolExecutor(max_workers=c) as pool:
                outs = list(pool.map(lambda p: post(a.proxy, {**body, "prompt": p, "stream": True, "stream_options": {"include_usage": True}}, True), prompts))
            ttft = [o[0] for o in outs]
            e2e = [o[1] for o in outs]
            case = {
                "prompt_chars": n,
                "prompt_tokens": statistics.median(o[2] for o in outs),
                "concurrency": c,
                "requests": len(outs),
                "prefill_alone_ms_p50": p_med * 1e3,
                "ttft_ms_p50": statistics.median(ttft) * 1e3,
                "ttft_ms_p90": pct(ttft, 0.9) * 1e3,
                "handoff_ms_p50": (statistics.median(ttft) - p_med) * 1e3,
                "e2e_ms_p50": statistics.median(e2e) * 1e3,
            }
            results["cases"].append(case)
            print(json.dumps({"label": a.label, **case}), flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
