"""Bidirectional KV transfer end to end (run through tests/e2e/run_multiturn_test.sh).

Two prefill vLLMs (no prefix caching) and two decode vLLMs (one of each with
GONIXL_MT_FLEET=1x1), all with GoNixlConnector and bidirectional_kv_xfer,
behind gonixl-proxy --multiturn (round robin over each: a turn's prefill
pulls from whichever decode served the previous turn, and its decode may be
the other one);
an aggregated vLLM gives the expected text of every turn for the same
history. A turn's prompt is the previous prompt, its answer and the new
message (tests/e2e/chat_template.jinja), so from turn 2 on the decode holds
the KV of the whole earlier conversation and the prefill pulls it back.

The prefills keep no prefix cache: a prompt token a prefill did not compute
is one it pulled. vLLM's own counters (prompt_tokens_by_source on the
prefills) must then equal, token for token, what the rules predict:
- a turn whose params the proxy had cached pulls min(n, prompt) tokens, n
  being the decode's computed tokens of the previous turn (prompt +
  completion - 1), unless that is below kv_recompute_threshold (64);
- an edited history pulls only the prefix that the decode's token digest
  vouches for (gonixl.digest: whole checkpoints of 256 tokens here);
- a miss (first turn, no conversation_id, a streamed turn — vLLM 0.32 puts
  kv_transfer_params in non-streaming bodies only —, a conversation idle
  past the decode's decoder_kv_blocks_ttl) computes the whole prompt.
Every turn's text must equal the baseline's.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_common import (
    PROMPT_TOKENS,
    counter,
    gonixl_metrics_urls,
    metrics,
    model_task,
    record_retry,
)

ENV = os.environ.get
PROXY = ENV("GONIXL_MT_PROXY")
BASELINE = ENV("GONIXL_MT_BASELINE")
PREFILLS = (ENV("GONIXL_MT_PREFILLS") or "").split()
DECODES = (ENV("GONIXL_MT_DECODES") or "").split()
LOGS = ENV("GONIXL_MT_LOGS", "")
MODEL = ENV("GONIXL_E2E_MODEL")
TTL = float(ENV("GONIXL_MT_TTL", "40"))

pytestmark = pytest.mark.skipif(
    not (PROXY and BASELINE and PREFILLS and DECODES),
    reason="run through tests/e2e/run_multiturn_test.sh (it starts the servers)",
)

INTEROP = ENV("GONIXL_MT_INTEROP", "0") == "1"
needs_gonixl_pairs = pytest.mark.skipif(
    INTEROP,
    reason="stock NixlConnector peers in the fleet: a stock decode sends no token digest or expiry, a stock prefill checks none",
)

THRESHOLD = 64  # kv_recompute_threshold's default in bidirectional mode
STEP = 256  # gonixl.digest checkpoints at block size 32
MAX_TOKENS = model_task.MAX_KEY_LEN + 2


def chat(
    url: str,
    messages: list[dict],
    conv: str | None = None,
    stream: bool = False,
    rid: str | None = None,
) -> tuple[str, dict]:
    body: dict = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 0,
    }
    if conv:
        body["conversation_id"] = conv
    if stream:
        body["stream"] = True
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"}
        | ({"x-request-id": rid} if rid else {}),
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            data = json.load(r)
            assert url != PROXY or "kv_transfer_params" not in data, (
                f"the proxy passed the decode's params on: {data}"
            )
            usage = dict(data.get("usage") or {})
            usage["finish_reason"] = data["choices"][0].get("finish_reason")
            return data["choices"][0]["message"]["content"], usage
        text = []
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:]).get("choices", []):
                text.append((ch.get("delta") or {}).get("content") or "")
        return "".join(text), {}


def prefill_sources() -> tuple[float, float]:
    """(local_compute, external_kv_transfer) prompt tokens, summed over the prefills."""
    texts = [metrics(u) for u in PREFILLS]
    return (
        sum(counter(t, PROMPT_TOKENS, source="local_compute") for t in texts),
        sum(counter(t, PROMPT_TOKENS, source="external_kv_transfer") for t in texts),
    )


ASYNC = ENV("GONIXL_TEST_ASYNC_SCHEDULING", "0") == "1"


def route_of(rid: str) -> tuple[bool, bool]:
    """(stock prefill, stock decode) of the turn whose X-Request-Id is rid,
    from gonixl-proxy's routing line (interop fleet: prefill1 and decode0
    are vLLM's stock NixlConnector)."""
    if not INTEROP:
        return False, False
    with open(os.path.join(LOGS, "proxy.log"), errors="replace") as f:
        lines = [ln for ln in f if '"routing"' in ln or "\trouting\t" in ln]
    for ln in reversed(lines):
        if f'"request_id": "{rid}"' in ln:
            pre = re.search(r'"prefill": "([^"]+)"', ln)
            dec = re.search(r'"decode": "([^"]+)"', ln)
            assert pre and dec, ln
            return pre.group(1) in PREFILLS[1], dec.group(1) in DECODES[0]
    raise AssertionError(f"no routing line for {rid} in the proxy's log")


def advertised(prompt: int, completion: int, finish: str | None, stock_decode: bool) -> int:
    """The tokens a decode's params say its blocks hold after a turn: a
    gonixl decode the written ones (prompt + completion - 1); vLLM's stock
    decode num_computed_tokens, which with async scheduling counts the
    last sampled token's step still in flight when the turn ended on a
    stop (a length-capped turn schedules no further step)."""
    n = prompt + completion - 1
    if stock_decode and ASYNC and finish == "stop":
        n += 1
    return n


@dataclasses.dataclass
class Turn:
    conv: str
    index: int
    prompt_tokens: int  # from the baseline's usage
    got: str
    want: str
    pulled: int  # expected external tokens on the prefill
    completion_tokens: int = 0
    # The turn's prefill read a stock decode's blocks with vLLM's stock
    # connector (interop fleet): vLLM's own pairing, not gonixl's.
    stock_pair: bool = False
    # It read a stock decode's blocks: vLLM's decode counts a step in flight
    # under async scheduling, so the pull may differ by a token either way.
    from_stock: bool = False
    # An earlier turn of its conversation was a stock_pair read-back: the KV
    # vLLM's bug put at one position of that history stays in the prefix
    # caches and in the blocks later turns pull, whoever pulls them.
    after_stock_pair: bool = False


def pulled_for(prompt: int, n_prev: int | None, matched: int | None = None) -> int:
    """Tokens the prefill pulls for a cached turn (0 for a miss)."""
    if n_prev is None:
        return 0
    n = min(n_prev, prompt) if matched is None else min(matched, n_prev, prompt)
    return n if n >= THRESHOLD else 0


def converse(
    conv: str,
    user_lengths: list[int],
    seed: int,
    *,
    send_id: bool = True,
    stream: bool = False,
    edit_at: dict | None = None,
    idle_before: dict | None = None,
    spacers: bool = False,
) -> list[Turn]:
    """A conversation through the proxy, each turn checked against the baseline.

    edit_at {turn: char}: before that turn, the first user message is edited
    at that character (the client rewrote its history). idle_before {turn:
    seconds}: the conversation pauses that long before the turn, past the
    proxy's cache TTL, so that the turn is a miss. spacers: one request of
    another client (no conversation_id) goes through the proxy between two
    turns, so that the round robins give a turn the prefill of the previous
    turn and that prefill reads from the previous turn's decode — the other
    implementation in the interop fleet.
    """
    users = [e.prompt for e in model_task.examples(seed, user_lengths)]
    history: list[dict] = []
    turns: list[Turn] = []
    n_prev: int | None = None
    prev_stock_decode = False
    tainted = False  # an earlier turn was a stock_pair read-back
    for k, u in enumerate(users):
        if spacers and k > 0:
            other = [
                {
                    "role": "user",
                    "content": model_task.examples(seed * 31 + k, [40])[0].prompt,
                }
            ]
            want, usage = chat(BASELINE, other)
            got, _ = chat(PROXY, other)
            turns.append(
                Turn(f"{conv}-spacer", k, int(usage["prompt_tokens"]), got, want, 0)
            )
        if idle_before and k in idle_before:
            time.sleep(idle_before[k])
            n_prev = None
        matched = None
        if edit_at and k in edit_at:
            pos = edit_at[k]
            first = history[0]["content"]
            history[0] = {
                "role": "user",
                "content": first[:pos]
                + ("a" if first[pos] != "a" else "b")
                + first[pos + 1 :],
            }
            matched = (pos // STEP) * STEP
        history.append({"role": "user", "content": u})
        want, usage = chat(BASELINE, history)
        # vLLM's request ids (prefill and decode) contain this X-Request-Id.
        got, dusage = chat(
            PROXY, history, conv if send_id else None, stream, rid=f"{conv}-t{k}-"
        )
        prompt = int(usage["prompt_tokens"])
        stock_prefill, stock_decode = route_of(f"{conv}-t{k}-")
        n_eff = n_prev
        if n_eff is not None and prev_stock_decode and not stock_prefill:
            # A gonixl prefill never pulls a stock decode's last advertised
            # token (it may be a step in flight: pybridge/gonixl/vllm.py).
            n_eff -= 1
        t = Turn(
            conv,
            k,
            prompt,
            got,
            want,
            pulled_for(prompt, n_eff, matched),
            int(dusage.get("completion_tokens", 0)),
            stock_prefill and prev_stock_decode and n_eff is not None,
            prev_stock_decode and n_eff is not None,
            tainted,
        )
        tainted = tainted or t.stock_pair
        turns.append(t)
        history.append({"role": "assistant", "content": got})
        # What the decode's params say it holds for the next turn.
        n_prev = (
            advertised(prompt, t.completion_tokens, dusage.get("finish_reason"), stock_decode)
            if (send_id and not stream and t.completion_tokens)
            else None
        )
        prev_stock_decode = stock_decode
    return turns


def check(
    turns: list[Turn],
    before: tuple[float, float],
    after: tuple[float, float],
    label: str,
) -> None:
    stock_wrong = [(t.conv, t.index, t.got, t.want) for t in turns if t.got != t.want and t.stock_pair]
    if stock_wrong:
        # vLLM's NixlConnector on both sides of a read-back: the stock
        # decode advertises a token still in flight under async scheduling
        # and the stock prefill pulls it (vLLM's bug, which gonixl's prefill
        # avoids); reported, not gonixl's to fail on.
        print(f"{label}: {len(stock_wrong)} turns read back between two stock NixlConnectors differ from the baseline: {stock_wrong}")
    after_wrong = [
        (t.conv, t.index, t.got, t.want) for t in turns if t.got != t.want and t.after_stock_pair and not t.stock_pair
    ]
    if after_wrong:
        # The same bug, one turn later: the history's KV vLLM's stock pair
        # wrote at one position is what this turn's prefix holds.
        print(
            f"{label}: {len(after_wrong)} turns after a stock NixlConnector read-back in their conversation "
            f"differ from the baseline: {after_wrong}"
        )
    stock_wrong += after_wrong
    wrong = [
        (t.conv, t.index, t.got, t.want)
        for t in turns
        if t.got != t.want and not t.stock_pair and not t.after_stock_pair
    ]
    computed, external = after[0] - before[0], after[1] - before[1]
    want_external = sum(t.pulled for t in turns)
    want_computed = sum(t.prompt_tokens - t.pulled for t in turns)
    hits = sum(t.pulled > 0 for t in turns)
    print(
        f"{label}: {len(turns)} turns, {len(turns) - len(wrong) - len(stock_wrong)} equal to the baseline"
        + (f" ({len(stock_wrong)} of the others read back between two stock connectors, or after such a turn)" if stock_wrong else "")
        + f"; {hits} pulled KV from the decode; "
        f"prefill prompt tokens: computed {computed:.0f} (want {want_computed}), pulled {external:.0f} (want {want_external})"
    )
    assert not wrong, (
        f"{label}: turns whose text differs from the baseline (conv, turn, got, want): {wrong}"
    )
    # Turns that read a stock decode: its advertised count is vLLM's
    # (num_computed_tokens with a step in flight or not), one token either
    # way per turn; every other turn's pull is exact.
    slack = sum(t.from_stock for t in turns)
    assert abs(external - want_external) <= slack, (
        f"{label}: the prefills pulled {external:.0f} prompt tokens, want {want_external}"
        + (f" (± {slack}: turns that read a stock decode)" if slack else "")
    )
    assert abs(computed - want_computed) <= slack, (
        f"{label}: the prefills computed {computed:.0f} prompt tokens, want {want_computed} (only the new ones)"
        + (f" (± {slack})" if slack else "")
    )


def log(name: str) -> str:
    with open(os.path.join(LOGS, name + ".log"), errors="replace") as f:
        return f.read()


def prefill_logs() -> str:
    return "".join(log(f"prefill{i}") for i in range(len(PREFILLS)))


def decode_logs() -> str:
    return "".join(log(f"decode{i}") for i in range(len(DECODES)))


@pytest.fixture(scope="module", autouse=True)
def warm_pairs():
    """First contacts before the measured tests: every prefill/decode pair
    handshakes in both directions (P -> D for a turn, D -> P for the next
    turn's pull) on one request at a time. vLLM's stock connector gives a
    handshake 5 s, which five vLLMs starting on two cores can exceed on a
    first contact made under load (seen once: a stock decode's first
    handshake with a gonixl prefill timed out, HTTP 500); a failed warm-up
    request is retried and printed."""
    if not (PROXY and BASELINE and PREFILLS and DECODES):
        yield
        return
    t0 = time.monotonic()
    notes = []

    def once(messages: list[dict], conv: str | None) -> str:
        for attempt in range(3):
            try:
                return chat(PROXY, messages, conv)[0]
            except urllib.error.HTTPError as e:
                notes.append(f"{conv or 'no id'} attempt {attempt}: HTTP {e.code}")
                # Counted: ./build.sh test fails the step past its allowance.
                record_retry(f"multi-turn warm-up request ({conv or 'no conversation_id'})", f"HTTP {e.code}: {e.read()[:160]!r}")
                time.sleep(2)
        return chat(PROXY, messages, conv)[0]

    for k in range(4):
        once(
            [{"role": "user", "content": model_task.examples(900 + k, [40])[0].prompt}],
            None,
        )
    for w in range(2):
        first = [
            {"role": "user", "content": model_task.examples(910 + w, [80])[0].prompt}
        ]
        answer = once(first, f"warm-{w}")
        once(
            [{"role": "user", "content": model_task.examples(920 + w, [40])[0].prompt}],
            None,
        )  # spacer
        once(
            first
            + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "?"},
            ],
            f"warm-{w}",
        )
        # Three requests: the next warm-up conversation gets the other pairing.
    print(
        f"warm-up: {time.monotonic() - t0:.1f} s"
        + (f"; retried: {'; '.join(notes)}" if notes else "")
    )
    yield


def digest_counts(name: str) -> dict[str, float]:
    """gonixl's KV digest counters of instance name (its log names the
    metrics server GONIXL_METRICS_PORT started)."""
    out = {"checked": 0.0, "unchecked": 0.0, "mismatches": 0.0}
    for _, url in gonixl_metrics_urls(log(name)):
        with urllib.request.urlopen(url, timeout=30) as r:
            text = r.read().decode()
        out["checked"] += counter(text, "gonixl_kv_digest_checked_blocks_total")
        out["unchecked"] += counter(text, "gonixl_kv_digest_unchecked_total")
        out["mismatches"] += counter(text, "gonixl_kv_digest_mismatches_total")
    return out


def check_digests(before: list[dict[str, float]]) -> None:
    """Every block the prefills read back since before was checked against
    the digest the decode's workers took of it (served on the decode's side
    channel, shim/kvdigest_readback.go): none unchecked, no mismatch."""
    after = [digest_counts(f"prefill{i}") for i in range(len(PREFILLS))]
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in after[0]}
    print(f"read-back KV digests: {delta}")
    assert delta["mismatches"] == 0, delta
    assert delta["unchecked"] == 0, f"read-backs read unchecked: {delta}"
    assert delta["checked"] > 0, f"no read-back block was checked: {delta}"
    decodes = "".join(log(f"decode{i}") for i in range(len(DECODES)))
    assert "serving KV digests of blocks held for read-back" in decodes


def test_concurrent_conversations_pull_the_history_back():
    before = prefill_sources()
    digests = [digest_counts(f"prefill{i}") for i in range(len(PREFILLS))]
    with cf.ThreadPoolExecutor(3) as pool:
        futs = [
            pool.submit(converse, f"conv-{i}", [150 - 20 * i, 100, 80, 60], 100 + i)
            for i in range(3)
        ]
        turns = [t for f in futs for t in f.result()]
    check(
        turns,
        before,
        prefill_sources(),
        "3 concurrent conversations of 4 turns"
        + (" (stock and gonixl mixed)" if INTEROP else ""),
    )
    assert sum(t.pulled > 0 for t in turns) == 9, (
        "every turn from the second on pulls the history"
    )
    if not INTEROP:  # a stock decode serves no digests
        check_digests(digests)


@needs_gonixl_pairs
def test_a_damaged_read_back_fails_its_turn():
    """The prefills run with GONIXL_TEST_KV_FAULT=1: a READ of a request
    whose id names kvfault-flip has a bit of its first block flipped after
    it landed. The read-back's check against the decode's digests catches
    it, and the turn fails (kv_load_failure_policy fail) instead of being
    answered from damaged KV; the turn before it is served."""
    before = [digest_counts(f"prefill{i}") for i in range(len(PREFILLS))]
    users = [e.prompt for e in model_task.examples(900, [150, 100])]
    conv = "conv-kvfault-flip"
    history = [{"role": "user", "content": users[0]}]
    got, _ = chat(PROXY, history, conv, rid=f"{conv}-t0-")
    assert got == chat(BASELINE, history)[0]
    history += [{"role": "assistant", "content": got}, {"role": "user", "content": users[1]}]
    with pytest.raises(urllib.error.HTTPError) as e:
        chat(PROXY, history, conv, rid=f"{conv}-t1-")
    assert e.value.code >= 500, e.value
    after = [digest_counts(f"prefill{i}") for i in range(len(PREFILLS))]
    assert sum(a["mismatches"] - b["mismatches"] for a, b in zip(after, before)) == 1
    lines = [ln for ln in prefill_logs().splitlines() if "kv_digest_mismatch" in ln and f"{conv}-t1-" in ln]
    assert lines and "differs from the decode's digests" in lines[0], lines


@pytest.mark.skipif(
    not INTEROP,
    reason="GONIXL_MT_INTEROP=1 only (stock NixlConnector peers in the fleet)",
)
def test_readback_crosses_implementations():
    # prefill0/decode1 are gonixl, prefill1/decode0 stock, and the proxy's two
    # round robins pair prefill i with decode i: with a spacer between turns,
    # a turn gets the previous turn's prefill, which reads the history from
    # the previous turn's decode: the other implementation.
    per = [
        (counter(metrics(u), PROMPT_TOKENS, source="external_kv_transfer"))
        for u in PREFILLS
    ]
    before = prefill_sources()
    turns = converse("conv-cross", [150, 100, 80], 600, spacers=True)
    # Five requests: the next conversation gets the other pairing.
    turns += converse("conv-cross-2", [150, 100, 80], 700, spacers=True)
    check(
        turns,
        before,
        prefill_sources(),
        "two conversations, spacers between turns (stock and gonixl read from each other)",
    )
    pulled = [
        counter(metrics(u), PROMPT_TOKENS, source="external_kv_transfer") - b
        for u, b in zip(PREFILLS, per)
    ]
    print(
        f"pulled from the decodes: gonixl prefill {pulled[0]:.0f} tokens, stock prefill {pulled[1]:.0f} tokens"
    )
    assert sum(t.pulled > 0 for t in turns) == 4
    assert all(x > 0 for x in pulled), (
        "both prefills (gonixl and stock) should have pulled a turn from the other's decode"
    )
    assert "carry no token digest (a stock NixlConnector decode)" in log("prefill0")


@needs_gonixl_pairs
def test_edited_history_pulls_only_the_unchanged_prefix():
    before = prefill_sources()
    # Turn 2 rewrites a character of the first message at 280 (the pull
    # stops at the checkpoint before it, 256), turn 3 at 100 (nothing is
    # pulled: the first checkpoint already differs).
    turns = converse("conv-edit", [300, 60, 60, 60], 200, edit_at={2: 280, 3: 100})
    check(turns, before, prefill_sources(), "edited history")
    assert [t.pulled for t in turns][2:] == [256, 0]
    text = prefill_logs()
    assert "after token 256: pulling the first 256 tokens" in text, (
        "no prefill logged the partial pull of the edited history"
    )
    assert "after token 0: pulling nothing" in text, (
        "no prefill logged the refused pull of the edited history"
    )


def test_turns_without_conversation_id_are_misses():
    before = prefill_sources()
    turns = converse("no-id", [120, 80, 60], 300, send_id=False)
    check(turns, before, prefill_sources(), "no conversation_id")


def test_streamed_turns_are_correct():
    before = prefill_sources()
    turns = converse("conv-stream", [120, 80, 60], 400, stream=True)
    check(turns, before, prefill_sources(), "streamed turns")


@needs_gonixl_pairs
def test_idle_conversation_falls_back_to_a_full_prefill():
    # The proxy still has the params (its cache TTL is longer here); the
    # decode freed the blocks at its TTL, and the prefill sees it from the
    # params' gonixl_expiry_unix and computes the prompt. Before it, a
    # two-turn conversation: its first turn's blocks are read back and must
    # be freed on the prefill's notification, its second turn's are never
    # read and must expire during the idle time.
    before = prefill_sources()
    freed = converse("conv-free", [100, 60], 510)
    idle = TTL + 3
    turns = converse("conv-idle", [150, 80, 60], 500, idle_before={1: idle})
    check(
        freed + turns,
        before,
        prefill_sources(),
        f"idle {idle:.0f} s before turn 2 (> decoder_kv_blocks_ttl {TTL:.0f} s)",
    )
    assert [t.pulled > 0 for t in freed + turns] == [False, True, False, False, True]
    text = prefill_logs()
    assert (
        "blocks of this conversation expired (decoder_kv_blocks_ttl): computing the whole prompt"
        in text
    )
    expired = [
        line
        for line in decode_logs().splitlines()
        if "Releasing expired KV blocks" in line
    ]
    held = {
        rid: any(rid in line for line in expired)
        for rid in ("conv-free-t0-", "conv-free-t1-", "conv-idle-t0-")
    }
    print(f"decode blocks released at the TTL (not read back): {held}")
    assert held == {
        "conv-free-t0-": False,
        "conv-free-t1-": True,
        "conv-idle-t0-": True,
    }, (
        "a turn read back must free the decode's blocks on the prefill's notification; unread turns expire"
    )
