"""gonixl behind vllm-router's vLLM P/D mode, beyond test_accuracy.py.

Started by run_router_test.sh (prefill and decode vLLM with GoNixlConnector,
vllm-router --vllm-pd-disaggregation in front, an aggregated baseline).
test_accuracy.py, run first against the router, checks plain completions.
Here:

- streamed completions through the router equal the baseline's text, and
  the decode pulled their prompts (the router sends the prefill stream=false
  and the decode the client's stream=true with the prefill's params);
- chat completions, streamed and not, equal the baseline's (the router
  re-serializes chat requests with fields of its own);
- the request id the router gives both legs (X-Request-Id
  "___prefill_addr_<prefill>___decode_addr_<decode>_<hex>") is the one
  each instance ran the request under, the same on both.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_common import SEED, complete, eval_examples, metrics, model_task, prompt_token_sources  # noqa: E402

ROUTER = os.environ.get("GONIXL_E2E_PROXY")
BASELINE = os.environ.get("GONIXL_E2E_BASELINE")
DECODE = os.environ.get("GONIXL_E2E_DECODE")
PREFILL = os.environ.get("GONIXL_E2E_PREFILL")
MODEL = os.environ.get("GONIXL_E2E_MODEL")
MAX_TOKENS = model_task.MAX_KEY_LEN + 2

pytestmark = pytest.mark.skipif(
    not (ROUTER and BASELINE and DECODE and PREFILL and os.environ.get("GONIXL_E2E_ROUTER_LOG")),
    reason="run through tests/e2e/run_router_test.sh (it starts the servers and vllm-router)",
)


def _post(url: str, path: str, body: dict, stream: bool) -> str:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            ch = json.load(r)["choices"][0]
            return ch["text"] if "text" in ch else ch["message"]["content"]
        out = []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return "".join(out)


def _completion(url: str, prompt: str, stream: bool) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 0, "stream": stream}
    return _post(url, "/v1/completions", body, stream)


def _chat(url: str, prompt: str, stream: bool) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 0,
        "stream": stream,
    }
    return _post(url, "/v1/chat/completions", body, stream)


def _examples_for(seed: int) -> list[model_task.Example]:
    # The edge cases (1 token, one block, one block + 1, ...) and a few more;
    # each test its own prompts (other seeds than test_accuracy.py's): a
    # prompt sent before would be found in the decode's prefix cache and
    # not pulled again.
    return eval_examples(8, SEED + seed)


def _check_pulled(before: str, after: str, examples: list[model_task.Example]) -> None:
    computed, external = prompt_token_sources(before, after)
    total = sum(len(e.prompt) for e in examples)
    one_token = sum(1 for e in examples if len(e.prompt) == 1)
    print(f"decode prompt tokens: local_compute {computed:.0f}, external_kv_transfer {external:.0f}, total {total}")
    assert computed + external == total
    assert computed <= one_token, f"the decode computed {computed} prompt tokens itself; only {one_token} 1-token prompts may be"


def test_streamed_completions_match_baseline():
    examples = _examples_for(19)
    base = [complete(BASELINE, MODEL, e) for e in examples]
    before = metrics(DECODE)
    got = [_completion(ROUTER, e.prompt, stream=True) for e in examples]
    after = metrics(DECODE)
    diff = [(len(e.prompt), b, g) for e, b, g in zip(examples, base, got) if b != g]
    assert not diff, f"{len(diff)} of {len(examples)} differ (prompt_len, baseline, streamed through vllm-router): {diff}"
    _check_pulled(before, after, examples)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_baseline(stream):
    examples = _examples_for(20 + stream)
    base = [_chat(BASELINE, e.prompt, stream=False) for e in examples]
    before = metrics(DECODE)
    got = [_chat(ROUTER, e.prompt, stream=stream) for e in examples]
    after = metrics(DECODE)
    diff = [(len(e.prompt), b, g) for e, b, g in zip(examples, base, got) if b != g]
    assert not diff, f"{len(diff)} of {len(examples)} differ (prompt_len, baseline, chat through vllm-router): {diff}"
    _check_pulled(before, after, examples)


def test_router_request_ids_on_both_instances():
    # vLLM runs a request as "<kind>-<X-Request-Id>-<suffix>" and logs it
    # ("Added request ...", --enable-log-requests).
    p_port, d_port = PREFILL.rsplit(":", 1)[1], DECODE.rsplit(":", 1)[1]
    pat = re.compile(
        r"Added request \S*___prefill_addr_127\.0\.0\.1:" + p_port + r"___decode_addr_127\.0\.0\.1:" + d_port + r"_([0-9a-f]{32})"
    )

    def ids(path: str) -> set[str]:
        with open(path, errors="replace") as f:
            return set(pat.findall(f.read()))

    prefill, decode = ids(os.environ["GONIXL_E2E_PREFILL_LOG"]), ids(os.environ["GONIXL_E2E_DECODE_LOG"])
    print(f"router request ids: {len(prefill)} on the prefill, {len(decode)} on the decode, {len(prefill & decode)} on both")
    assert len(decode) >= 8 and decode <= prefill, "every request the decode ran under a router id was prefilled under the same id"
