"""Helpers shared by the end-to-end tests (test_accuracy.py, test_interop.py).

HTTP calls to vLLM's OpenAI server and gonixl-proxy, Prometheus counters,
the prompt set from tests/fixtures/model_task.py, and log scanning. Pure
standard library; the servers are started by the run_*_test.sh scripts.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
sys.path.append(os.path.join(HERE, ".."))
import model_task
from testreport import record_retry  # noqa: F401  (re-exported: a first try that failed, for ./build.sh test's count)

BLOCK = 32
SEED = 2026
PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"


def post(url: str, body: dict, timeout: float = 300, path: str = "/v1/completions", request_id: str = "") -> dict:
    headers = {"content-type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id  # gonixl-proxy and vLLM keep it in their logs
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prompt_token_sources(before: str, after: str) -> tuple[float, float]:
    """(local_compute, external_kv_transfer) prompt tokens between two /metrics texts.

    vLLM counts a request whose whole prompt came from the connector as
    external (its last token is re-run for logits but not counted as
    computed). Only 1-token prompts have nothing to pull: the decode computes
    them itself.
    """

    def delta(source: str) -> float:
        return counter(after, PROMPT_TOKENS, source=source) - counter(before, PROMPT_TOKENS, source=source)

    return delta("local_compute"), delta("external_kv_transfer")


def completion(url: str, model: str, ex: model_task.Example, timeout: float = 300, request_id: str = "") -> dict:
    """The whole /v1/completions response for ex (greedy, room for the longest key)."""
    body = {
        "model": model,
        "prompt": ex.prompt,
        "max_tokens": model_task.MAX_KEY_LEN + 2,
        "temperature": 0,
        "seed": 0,
    }
    return post(url, body, timeout=timeout, request_id=request_id)


# gonixl's warnings that say where a slow request's time went (shim/pollgap.go).
STALL_HINTS = ("did not poll the connector", "the worker's lock", "READ still in flight", "slow READ completed")


def _iso_ts(line: str) -> float | None:
    """Seconds since the epoch of a gonixl (zap) log line, None for other lines."""
    head = line.split("\t", 1)[0]
    try:
        return datetime.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
    except ValueError:
        return None


def where_time_went(request_id: str, started: float, seconds: float, proxy_log: str, logs: dict[str, str]) -> str:
    """One line on a slow request sent through gonixl-proxy with X-Request-Id
    request_id at wall time started: how long its prefill leg took (the
    proxy's routing line), the gonixl lines naming it in each instance's log,
    and the stall hints (STALL_HINTS) logged while it ran."""

    def read(path: str) -> list[str]:
        try:
            with open(path, errors="replace") as f:
                return f.read().splitlines()
        except OSError:
            return []

    parts = []
    route = [ln for ln in read(proxy_log) if request_id in ln and "routing" in ln]
    if route and '"concurrent": true' in route[0]:
        parts.append("push: prefill and decode requests sent at once (proxy)")
    elif route:
        m = re.search(r'"prefill_took": ([0-9.e+-]+)', route[0])
        took = float(m.group(1)) if m else float("nan")
        parts.append(f"prefill leg {took:.1f} s, decode leg {seconds - took:.1f} s (proxy)")
    else:
        parts.append("no routing line in the proxy log: the prefill never answered")
    for name, path in logs.items():
        lines = read(path)
        mine = [ln.split("\t", 3)[-1][:160] for ln in lines if request_id in ln and "gonixl" in ln]
        hints = []
        for ln in lines:
            t = _iso_ts(ln)
            if t is not None and started <= t <= started + seconds + 1 and any(h in ln for h in STALL_HINTS):
                hints.append(ln.split("\t", 3)[-1][:200])
        if mine or hints:
            parts.append(f"{name}: {len(mine)} gonixl lines naming it {mine[:2]}, stall hints {hints[:3]}")
    return f"request {request_id} took {seconds:.1f} s: " + "; ".join(parts)


def complete(url: str, model: str, ex: model_task.Example) -> str:
    return completion(url, model, ex)["choices"][0]["text"]


def eval_examples(n: int, seed: int = SEED) -> list[model_task.Example]:
    """n prompts with the edge cases: 1 token, one block, one block + 1, several blocks."""
    exs = model_task.examples(seed, model_task.eval_lengths(n, seed, block_size=BLOCK))
    assert any(len(e.prompt) == 1 for e in exs)
    assert any(len(e.prompt) == BLOCK for e in exs)
    assert any(len(e.prompt) == BLOCK + 1 for e in exs)
    assert any(len(e.prompt) > 4 * BLOCK for e in exs)
    return exs


def read_from(path: str, offset: int = 0) -> str:
    """The text of a log file from byte offset on."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def samples(text: str, name: str, **labels: str) -> list[float]:
    """Every value of metric name (whose labels include labels) in a /metrics text; [] when absent.

    Unlike counter(), an absent metric is visible to the caller (a leak check
    on a metric that is not exported must fail, not read 0).
    """
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def gonixl_metrics_urls(log_text: str) -> list[tuple[str, str]]:
    """(role, url) of each "gonixl metrics served" line of a vLLM log (GONIXL_METRICS_PORT).

    One line per process that serves: an engine that joins the server already
    running in its process logs none.
    """
    return re.findall(r'gonixl metrics served\s+\{"role": "(\w+)".*?"url": "([^"]+)"', log_text)
