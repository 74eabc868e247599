"""End-to-end accuracy of disaggregated prefill -> decode through gonixl.

Started by run_accuracy_test.sh, which brings up a prefill vLLM, a decode
vLLM (both with GoNixlConnector), gonixl-proxy in front of them, and an
aggregated vLLM without a connector as the baseline. Asserts:

- every response through the proxy equals the baseline's, token for token
  (greedy), for prompts of 1 token, exactly one block, one block + 1, many
  blocks, and random lengths, some sent concurrently;
- the task accuracy through the proxy is at least the baseline's;
- the decode instance computed no prompt token itself except for 1-token
  prompts (vLLM's own vllm:prompt_tokens_by_source counters), so the KV came
  over the wire;
- the decode's "KV Transfer metrics" log lines count the expected number of
  successful transfers.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_common import BLOCK, SEED, complete, eval_examples, metrics, model_task, prompt_token_sources  # noqa: E402

PROXY = os.environ.get("GONIXL_E2E_PROXY")
BASELINE = os.environ.get("GONIXL_E2E_BASELINE")
DECODE = os.environ.get("GONIXL_E2E_DECODE")
PREFILL = os.environ.get("GONIXL_E2E_PREFILL")
DECODE_LOG = os.environ.get("GONIXL_E2E_DECODE_LOG")
MODEL = os.environ.get("GONIXL_E2E_MODEL")
N_PROMPTS = int(os.environ.get("GONIXL_E2E_PROMPTS", "64"))

pytestmark = pytest.mark.skipif(
    not (PROXY and BASELINE and DECODE and PREFILL),
    reason="run through tests/e2e/run_accuracy_test.sh (it starts the servers)",
)


@pytest.fixture(scope="module")
def examples() -> list[model_task.Example]:
    return eval_examples(N_PROMPTS, SEED)


@pytest.fixture(scope="module")
def runs(examples):
    before = metrics(DECODE)
    # Baseline first, sequentially; then through the proxy: a sequential
    # part and a concurrent part.
    base = [complete(BASELINE, MODEL, e) for e in examples]
    half = len(examples) // 2
    disagg = [complete(PROXY, MODEL, e) for e in examples[:half]]
    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        disagg += list(pool.map(lambda e: complete(PROXY, MODEL, e), examples[half:]))
    after = metrics(DECODE)
    return base, disagg, before, after


def test_outputs_match_baseline(examples, runs):
    base, disagg, _, _ = runs
    mismatches = [(len(e.prompt), b, d) for e, b, d in zip(examples, base, disagg) if b != d]
    assert not mismatches, f"{len(mismatches)} of {len(examples)} differ (prompt_len, baseline, disaggregated): {mismatches[:10]}"


def test_accuracy_at_least_baseline(examples, runs):
    base, disagg, _, _ = runs
    b_ok, n = model_task.accuracy(list(zip(examples, base)))
    d_ok, n2 = model_task.accuracy(list(zip(examples, disagg)))
    assert n == n2 and n > 0
    print(f"accuracy: baseline {b_ok}/{n}, disaggregated {d_ok}/{n2}")
    assert d_ok >= b_ok


def test_decode_loaded_kv_over_the_wire(examples, runs):
    _, _, before, after = runs
    computed, external = prompt_token_sources(before, after)
    total = sum(len(e.prompt) for e in examples)
    one_token = sum(1 for e in examples if len(e.prompt) == 1)
    # Only 1-token prompts have nothing to pull (prompt_token_sources).
    print(f"decode prompt tokens: local_compute {computed:.0f}, external_kv_transfer {external:.0f}, total {total}")
    assert computed + external == total, f"token accounting: computed {computed} + external {external} != {total}"
    assert computed <= one_token, f"decode computed {computed} prompt tokens itself; only {one_token} 1-token prompts may be"
    assert external >= total - one_token


def test_kv_transfer_metrics_line(examples, runs):
    # vLLM logs the aggregated stats every few seconds; wait for the lines
    # that cover our requests (bounded).
    want = sum(1 for e in examples if len(e.prompt) > 1)
    pat = re.compile(r"KV Transfer metrics: Num successful transfers=(\d+)")
    deadline = time.time() + 60
    got = 0
    while time.time() < deadline:
        with open(DECODE_LOG, errors="replace") as f:
            got = sum(int(m.group(1)) for m in pat.finditer(f.read()))
        if got >= want:
            break
        time.sleep(2)
    print(f"KV Transfer metrics: {got} successful transfers logged, {want} expected at least")
    assert got >= want
    with open(DECODE_LOG, errors="replace") as f:
        log = f.read()
    assert "NIXL transfer failure" not in log


@pytest.mark.skipif(os.environ.get("GONIXL_UCX_DATA_PATH") != "shm", reason="runs with GONIXL_UCX_DATA_PATH=shm only")
def test_shm_data_path_used(examples, runs):
    # With data path shm the prefill re-backs its KV cache with a memfd and
    # the decode maps it: both must say so, or the run measured another path.
    with open(os.environ["GONIXL_E2E_PREFILL_LOG"], errors="replace") as f:
        prefill = f.read()
    with open(DECODE_LOG, errors="replace") as f:
        decode = f.read()
    shared = re.search(r"shm: (\d+) of (\d+) regions shared", prefill)
    mapped = re.search(r"data path shm: (\d+) of (\d+) shared regions of \S+ mapped", decode)
    print("prefill:", shared and shared.group(0), "| decode:", mapped and mapped.group(0))
    assert shared and int(shared.group(1)) == int(shared.group(2)) > 0
    assert mapped and int(mapped.group(1)) == int(mapped.group(2)) > 0


def test_transfer_engine_used(examples, runs):
    # Both workers must run the engine the run asked for (GONIXL_E2E_ENGINE,
    # default ucx): a silent fallback would make the run test another engine.
    want = os.environ.get("GONIXL_E2E_ENGINE", "ucx")
    for name in ("GONIXL_E2E_PREFILL_LOG", "GONIXL_E2E_DECODE_LOG"):
        with open(os.environ[name], errors="replace") as f:
            log = f.read()
        engines = re.findall(r'transfer engine selected\s+\{.*?"engine": "(\w+)"', log)
        print(name, "engines:", engines)
        assert engines, f"no 'transfer engine selected' line in {name}"
        if want != "auto":
            assert set(engines) == {want}, f"{name}: engines {engines}, want {want}"


@pytest.mark.skipif(not os.environ.get("GONIXL_E2E_DECODE_BLOCK_SIZE"), reason="runs with GONIXL_E2E_DECODE_BLOCK_SIZE only")
def test_decode_read_smaller_prefill_blocks(examples, runs):
    # The decode's block size is a multiple of the prefill's: its handshake
    # must have agreed on that ratio (else it read nothing of another size,
    # and the token-exact outputs above would prove less).
    want = int(os.environ["GONIXL_E2E_DECODE_BLOCK_SIZE"]) // 32
    with open(DECODE_LOG, errors="replace") as f:
        ratios = re.findall(r'handshake done\s+\{.*?"block_ratio": (\d+)', f.read())
    print("decode handshakes, block_ratio:", ratios)
    assert ratios and set(ratios) == {str(want)}, f"block ratios {ratios}, want {want}"
