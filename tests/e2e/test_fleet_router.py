"""vllm-router's prefill policies in front of gonixl (phase 2 of
tests/e2e/run_fleet_test.sh, which starts the servers and the routers).

Two prefill vLLMs with prefix caching and two decode vLLMs, all with
GoNixlConnector; two vllm-routers in P/D mode over the same instances, one
with --prefill-policy round_robin and one with --prefill-policy cache_aware.
The same shape of workload goes through each: groups of prompts that share a
long prefix, in a shuffled order, one request at a time, each group's prefix
its own to the policy (no cache carries over from one policy's run to the
other's). Every output must equal the aggregated baseline's; the prefills'
local_cache_hit prompt tokens (vllm:prompt_tokens_by_source) are printed per
policy, and cache_aware must hit at least as much as round_robin.
"""

from __future__ import annotations

import json
import os
import random
import sys
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
import model_task

ENV = os.environ.get
BASELINE = ENV("GONIXL_FLEET_BASELINE")
PREFILLS = (ENV("GONIXL_FLEET_PREFILLS") or "").split()
ROUTERS = dict(x.split("=", 1) for x in (ENV("GONIXL_FLEET_ROUTERS") or "").split())
MODEL = ENV("GONIXL_E2E_MODEL")

pytestmark = pytest.mark.skipif(
    not (
        BASELINE
        and len(PREFILLS) == 2
        and set(ROUTERS) == {"round_robin", "cache_aware"}
    ),
    reason="run through tests/e2e/run_fleet_test.sh (phase 2 starts the routers)",
)

PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
GROUPS, PER_GROUP, PREFIX, SUFFIX = 3, 6, 256, 48


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prefill_sources() -> dict[str, float]:
    out = {"local_compute": 0.0, "local_cache_hit": 0.0, "external_kv_transfer": 0.0}
    for u in PREFILLS:
        with urllib.request.urlopen(u + "/metrics", timeout=30) as r:
            text = r.read().decode()
        for k in out:
            out[k] += counter(text, PROMPT_TOKENS, source=k)
    return out


def complete(url: str, prompt: str) -> str:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": model_task.MAX_KEY_LEN + 2,
        "temperature": 0,
        "seed": 0,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["text"]


def workload(seed: int) -> list[str]:
    """GROUPS x PER_GROUP prompts: a shared prefix of PREFIX characters (one
    token each for the fixture model) and a suffix of their own, shuffled."""
    prompts = []
    for g in range(GROUPS):
        prefix = model_task.examples(seed * 100 + g, [PREFIX])[0].prompt
        for s in range(PER_GROUP):
            prompts.append(
                prefix
                + model_task.examples(seed * 100 + 50 + g * PER_GROUP + s, [SUFFIX])[
                    0
                ].prompt
            )
    random.Random(seed).shuffle(prompts)
    return prompts


def test_cache_aware_prefill_policy_against_round_robin():
    rows = []
    for i, policy in enumerate(["round_robin", "cache_aware"]):
        prompts = workload(7000 + i)
        want = [complete(BASELINE, p) for p in prompts]
        before = prefill_sources()
        got = [complete(ROUTERS[policy], p) for p in prompts]
        after = prefill_sources()
        d = {k: after[k] - before[k] for k in after}
        wrong = [(k, g, w) for k, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not wrong, (
            f"{policy}: outputs differ from the baseline (index, got, want): {wrong}"
        )
        total = sum(d.values())
        rows.append(
            (policy, len(prompts), total, d["local_cache_hit"], d["local_compute"])
        )
    print(
        "\n| prefill policy | requests | prompt tokens | local_cache_hit | computed | hit share |"
    )
    print("|---|---|---|---|---|---|")
    for policy, n, total, hit, comp in rows:
        print(
            f"| {policy} | {n} | {total:.0f} | {hit:.0f} | {comp:.0f} | {hit / total:.2f} |"
        )
    rr, ca = rows[0][3], rows[1][3]
    best = (
        GROUPS * (PER_GROUP - 1) * (PREFIX // 32) * 32
    )  # each group's first request misses, its prefix blocks hit after
    print(
        f"cache_aware {ca:.0f} / round_robin {rr:.0f} local_cache_hit tokens; the workload's best is {best}"
    )
    assert ca > 0, "cache_aware routing gave no prefix-cache hit on the prefills"
    assert ca >= rr, f"cache_aware hit {ca:.0f} tokens, round_robin {rr:.0f}"
