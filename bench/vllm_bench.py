"""Client of ./build.sh bench and ./build.sh bench-push (bench/run_vllm_bench.sh):
one deployment (a prefill vLLM, a decode vLLM, gonixl-proxy in front), one
set of cases, every request's timeline written raw for bench/vllm_report.py.

Per case (prompt length × concurrency) it sends fresh prompts (no prefix-cache
hit anywhere: each prompt starts differently) as streamed completions through
the proxy, closed loop with CONCURRENCY clients, and records per request the
wall-clock send time, first streamed token and end, and the X-Request-Id it
sent (the proxy forwards it to both instances, and vLLM's request ids embed
it; the connector wrapper of bench/timed_connector.py logs those ids with the
prefill's finish and the decode's KV-ready times). Around each case it reads
both instances' /metrics (vLLM's NIXL histograms: descriptors and bytes
per transfer). Wall time is the join key: all processes run on this host.

Usage: vllm_bench.py --proxy URL --prefill URL --decode URL --model PATH --label NAME
       --lengths 128,1000 --concurrency 1,8,32 --out FILE.json
Standard library plus tqdm (a vLLM dependency) for the progress bar.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import random
import re
import sys
import time
import urllib.request
import uuid

from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
import model_task

# A request slower than this is recorded as failed (vLLM's stock push decode
# waits without bound for a WRITE its prefill never makes).
REQUEST_TIMEOUT_S = float(os.environ.get("GONIXL_BENCH_REQUEST_TIMEOUT", "120"))

_rng = random.Random(int(os.environ.get("GONIXL_BENCH_SEED", "7")))


def fresh(n: int) -> str:
    return model_task.make_example(_rng, n).prompt


def post(url: str, body: dict, rid: str) -> dict:
    """One streamed completion: its wall-clock timeline."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-request-id": rid},
    )
    sent = time.time()
    first, prompt_tokens, text = None, 0, []
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or ():
                    if c.get("text"):
                        if first is None:
                            first = time.time()
                        text.append(c["text"])
                if chunk.get("usage"):
                    prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
    except OSError as e:  # refused, timed out, HTTP error: counted, not fatal
        return {"id": rid, "sent": sent, "error": f"{type(e).__name__}: {e}", "end": time.time()}
    end = time.time()
    return {"id": rid, "sent": sent, "first": first if first is not None else end, "end": end, "prompt_tokens": prompt_tokens, "text": "".join(text)}


_METRIC = re.compile(r"^(vllm:nixl_(?:num_descriptors|bytes_transferred|xfer_time_seconds|post_time_seconds))_(sum|count)(\{[^}]*\})?\s+([0-9.eE+-]+)$")


def nixl_metrics(url: str) -> dict[str, float]:
    """Sum over label sets of vLLM's NIXL histograms' _sum and _count."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            for raw in r:
                m = _METRIC.match(raw.decode().strip())
                if m:
                    k = f"{m.group(1)}_{m.group(2)}"
                    out[k] = out.get(k, 0.0) + float(m.group(4))
    except OSError as e:
        print(f"vllm_bench: /metrics of {url}: {e}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxy", required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--lengths", default="128,1000")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--min-requests", type=int, default=16, help="per case; at least 2 × concurrency are sent")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    body = {"model": a.model, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tag = uuid.uuid4().hex[:6]

    def rid(case: str, i: int) -> str:
        return f"bench-{a.label}-{tag}-{case}-{i:05d}"

    # Warm-up: handshakes, first transfers, each length once.
    for i, n in enumerate([64, *lengths, *lengths]):
        post(a.proxy, {**body, "prompt": fresh(n)}, rid("warm", i))
    results: dict = {"label": a.label, "cases": []}
    total = sum(max(a.min_requests, 2 * c) for c in concs) * len(lengths)
    bar = tqdm(total=total, desc=a.label, unit="req", file=sys.stderr, mininterval=2.0)
    for n in lengths:
        for c in concs:
            count = max(a.min_requests, 2 * c)
            case = f"{n}x{c}"
            prompts = [fresh(n) for _ in range(count)]
            m0 = {"prefill": nixl_metrics(a.prefill), "decode": nixl_metrics(a.decode)}
            t0 = time.time()

            def one(i: int, case: str = case, prompts: list[str] = prompts) -> dict:
                r = post(a.proxy, {**body, "prompt": prompts[i]}, rid(case, i))
                # The report compares outputs across deployments by prompt.
                r["prompt_sha"] = hashlib.sha256(prompts[i].encode()).hexdigest()[:16]
                bar.update(1)
                return r

            with cf.ThreadPoolExecutor(max_workers=c) as pool:
                reqs = list(pool.map(one, range(count)))
            t1 = time.time()
            m1 = {"prefill": nixl_metrics(a.prefill), "decode": nixl_metrics(a.decode)}
            results["cases"].append(
                {
                    "prompt_len": n,
                    "concurrency": c,
                    "start": t0,
                    "end": t1,
                    "requests": reqs,
                    "metrics": {side: {k: v - m0[side].get(k, 0.0) for k, v in m1[side].items()} for side in m1},
                }
            )
    bar.close()
    with open(a.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
