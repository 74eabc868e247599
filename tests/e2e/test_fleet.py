"""A fleet of gonixl-proxy replicas sharing their conversations through Redis
(run through tests/e2e/run_fleet_test.sh, which starts vLLM and redis-server).

Two prefill vLLMs (no prefix caching) and two decode vLLMs, all with
GoNixlConnector and bidirectional_kv_xfer; two gonixl-proxy --multiturn
replicas (started and restarted by this test) with --state-store
redis://...; an aggregated vLLM gives the expected text of every turn.

test_turns_alternate_between_replicas: conversations whose turns go to
replica A, then B, then A, then B, with replica A restarted before the third
turn. Every turn's text equals the baseline's, and the prefills' own
counters (vllm:prompt_tokens_by_source) equal, token for token, what a turn
that found the previous turn's params pulls: from turn 2 on the prefill
pulled the history whichever replica served the previous turn, and the
restarted replica forgot nothing.

test_transferred_blocks_are_published: KV events (--kv-events-config, ZMQ
publisher) of the decodes and of the baseline. A prompt that reaches a
decode by transfer is published by that decode as BlockStored with the same
block hashes and tokens as the baseline publishes for computing it.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "fixtures"))
import model_task

ENV = os.environ.get
BASELINE = ENV("GONIXL_FLEET_BASELINE")
PREFILLS = (ENV("GONIXL_FLEET_PREFILLS") or "").split()
DECODES = (ENV("GONIXL_FLEET_DECODES") or "").split()
PROXY_BIN = ENV("GONIXL_FLEET_PROXY_BIN")
PROXY_ARGS = json.loads(ENV("GONIXL_FLEET_PROXY_ARGS") or "[]")
PROXY_PORTS = (ENV("GONIXL_FLEET_PROXY_PORTS") or "").split()
EVENTS = json.loads(ENV("GONIXL_FLEET_EVENTS") or "{}")  # name -> ZMQ endpoint
LOGS = ENV("GONIXL_FLEET_LOGS", "")
MODEL = ENV("GONIXL_E2E_MODEL")

pytestmark = pytest.mark.skipif(
    not (
        BASELINE
        and len(PREFILLS) == 2
        and len(DECODES) == 2
        and PROXY_BIN
        and len(PROXY_PORTS) == 2
    ),
    reason="run through tests/e2e/run_fleet_test.sh (it starts the servers)",
)

PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
THRESHOLD = 64  # kv_recompute_threshold's default in bidirectional mode
BLOCK = 32
MAX_TOKENS = model_task.MAX_KEY_LEN + 2


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def post(url: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"} | (headers or {}),
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def sources(urls: list[str]) -> tuple[float, float]:
    """(local_compute, external_kv_transfer) prompt tokens summed over urls."""
    texts = [get(u + "/metrics") for u in urls]
    return (
        sum(counter(t, PROMPT_TOKENS, source="local_compute") for t in texts),
        sum(counter(t, PROMPT_TOKENS, source="external_kv_transfer") for t in texts),
    )


def chat(
    url: str, messages: list[dict], conv: str | None = None, rid: str = ""
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
    data = post(
        url + "/v1/chat/completions", body, {"x-request-id": rid} if rid else None
    )
    # vLLM answers with "kv_transfer_params": null; the proxy drops the
    # decode's params from its answer.
    assert url == BASELINE or "kv_transfer_params" not in data, (
        f"params reached the client: {data}"
    )
    return data["choices"][0]["message"]["content"], data.get("usage") or {}


class Replica:
    """One gonixl-proxy process; its log is appended to $LOGS/proxy-NAME.log."""

    def __init__(self, name: str, port: str):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(os.path.join(LOGS, f"proxy-{self.name}.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [PROXY_BIN, *PROXY_ARGS, "--port", self.port],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                get(self.url + "/healthcheck")
                return
            except OSError:
                assert self.proc.poll() is None, (
                    f"proxy {self.name} exited with {self.proc.returncode}"
                )
                assert time.monotonic() < deadline, (
                    f"proxy {self.name} not ready after 30 s"
                )
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def metric(self, name: str, **labels: str) -> float:
        return counter(get(self.url + "/metrics"), name, **labels)


@pytest.fixture(scope="module")
def replicas():
    rs = [Replica("a", PROXY_PORTS[0]), Replica("b", PROXY_PORTS[1])]
    try:
        for r in rs:
            r.start()
        yield rs
    finally:
        for r in rs:
            r.stop()


class Events:
    """BlockStored events of each named ZMQ publisher, collected by a thread."""

    def __init__(self, endpoints: dict[str, str]):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        self._msgspec = msgspec
        self._stored = BlockStored
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.ctx = zmq.Context()
        self.socks = {}
        for name, ep in endpoints.items():
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(ep)
            self.socks[s] = name
        self.lock = threading.Lock()
        self.got: list[
            tuple[float, str, object]
        ] = []  # (arrival, publisher, BlockStored)
        self.batches = {name: 0 for name in endpoints}
        self.errors: list[str] = []  # batches that did not decode
        self.stop = threading.Event()
        self.poller = zmq.Poller()
        for s in self.socks:
            self.poller.register(s, zmq.POLLIN)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for s, _ in self.poller.poll(200):
                frames = s.recv_multipart()
                try:
                    batch = self._decoder.decode(frames[-1])
                except self._msgspec.DecodeError as e:  # ValidationError is one
                    self.errors.append(f"{self.socks[s]}: {e!r}")
                    continue
                now = time.monotonic()
                with self.lock:
                    self.batches[self.socks[s]] += 1
                    for ev in batch.events:
                        if isinstance(ev, self._stored):
                            self.got.append((now, self.socks[s], ev))

    def blocks(
        self, since: float, names: set[str]
    ) -> dict[int, tuple[str, tuple[int, ...]]]:
        """hash -> (publisher, the block's tokens) of BlockStored events since since."""
        out = {}
        with self.lock:
            for t, name, ev in self.got:
                if t < since or name not in names:
                    continue
                bs = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    out[h] = (name, tuple(ev.token_ids[i * bs : (i + 1) * bs]))
        return out

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.socks:
            s.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def events():
    if not EVENTS:
        pytest.fail(
            "GONIXL_FLEET_EVENTS is empty: run_fleet_test.sh gives the decodes and the baseline --kv-events-config"
        )
    ev = Events(EVENTS)
    time.sleep(1)  # subscriptions reach the publishers before anything is published
    yield ev
    ev.close()


@pytest.fixture(scope="module", autouse=True)
def warm_pairs(replicas):
    """First contacts (handshakes in both directions between every prefill
    and decode) before the measured tests, through replica A."""
    a = replicas[0]
    for k in range(4):
        chat(
            a.url,
            [{"role": "user", "content": model_task.examples(900 + k, [40])[0].prompt}],
        )
    for w in range(2):
        first = [
            {"role": "user", "content": model_task.examples(910 + w, [80])[0].prompt}
        ]
        answer, _ = chat(a.url, first, f"warm-{w}")
        chat(
            a.url,
            [{"role": "user", "content": model_task.examples(920 + w, [40])[0].prompt}],
        )
        chat(
            a.url,
            first
            + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "?"},
            ],
            f"warm-{w}",
        )
    yield


@dataclasses.dataclass
class Turn:
    conv: str
    index: int
    replica: str
    prompt_tokens: int
    got: str
    want: str
    pulled: int  # expected external tokens on the prefill


def test_turns_alternate_between_replicas(replicas):
    a, b = replicas
    convs = [f"fleet-{i}" for i in range(3)]
    users = {
        c: [e.prompt for e in model_task.examples(100 + i, [150 - 20 * i, 100, 80, 60])]
        for i, c in enumerate(convs)
    }
    history: dict[str, list[dict]] = {c: [] for c in convs}
    n_prev: dict[str, int | None] = {c: None for c in convs}
    turns: list[Turn] = []
    hits_before = {
        r.name: r.metric("gonixl_proxy_conversation_cache_hits_total") for r in replicas
    }
    before = sources(PREFILLS)

    def one(conv: str, k: int, r: Replica) -> Turn:
        history[conv].append({"role": "user", "content": users[conv][k]})
        want, usage = chat(BASELINE, history[conv])
        got, dusage = chat(r.url, history[conv], conv, rid=f"{conv}-t{k}-")
        prompt = int(usage["prompt_tokens"])
        pulled = 0
        if n_prev[conv] is not None and min(n_prev[conv], prompt) >= THRESHOLD:
            pulled = min(n_prev[conv], prompt)
        history[conv].append({"role": "assistant", "content": got})
        completion = int(dusage.get("completion_tokens", 0))
        # What the decode holds for the next turn: its computed tokens.
        n_prev[conv] = prompt + completion - 1 if completion else None
        return Turn(conv, k, r.name, prompt, got, want, pulled)

    a_hits_before_restart = 0.0
    for k in range(4):
        r = (a, b)[k % 2]
        if k == 2:
            a_hits_before_restart = (
                a.metric("gonixl_proxy_conversation_cache_hits_total")
                - hits_before["a"]
            )
            a.stop()
            a.start()  # a new process: its memory is empty, the store is not
            hits_before["a"] = 0.0
        with cf.ThreadPoolExecutor(len(convs)) as pool:
            turns += list(pool.map(one, convs, [k] * len(convs), [r] * len(convs)))
    after = sources(PREFILLS)

    wrong = [
        (t.conv, t.index, t.replica, t.got, t.want) for t in turns if t.got != t.want
    ]
    computed, external = after[0] - before[0], after[1] - before[1]
    want_external = sum(t.pulled for t in turns)
    want_computed = sum(t.prompt_tokens - t.pulled for t in turns)
    hits = {
        r.name: r.metric("gonixl_proxy_conversation_cache_hits_total")
        - hits_before[r.name]
        for r in replicas
    }
    errors = sum(r.metric("gonixl_proxy_state_store_errors_total") for r in replicas)
    print(
        f"{len(turns)} turns over replicas a, b, a (restarted), b: {len(turns) - len(wrong)} equal to the baseline; "
        f"{sum(t.pulled > 0 for t in turns)} pulled the history; prefill prompt tokens computed {computed:.0f} "
        f"(want {want_computed}), pulled {external:.0f} (want {want_external}); cache hits a {a_hits_before_restart:.0f} "
        f"then a' {hits['a']:.0f}, b {hits['b']:.0f}; store errors {errors:.0f}"
    )
    assert not wrong, (
        f"turns whose text differs from the baseline (conv, turn, replica, got, want): {wrong}"
    )
    assert all(t.pulled > 0 for t in turns if t.index > 0), (
        f"a turn from the second on would not pull (prompt or history below {THRESHOLD} tokens): "
        f"{[(t.conv, t.index, t.pulled) for t in turns]}"
    )
    assert external == want_external, (
        f"the prefills pulled {external:.0f} prompt tokens, want {want_external}"
    )
    assert computed == want_computed, (
        f"the prefills computed {computed:.0f} prompt tokens, want {want_computed}"
    )
    assert (a_hits_before_restart, hits["a"], hits["b"]) == (0, 3, 6), (
        "cache hits per replica: turn 1 misses on a, turns 2 and 4 hit on b, turn 3 hits on the restarted a"
    )
    assert errors == 0


def tokenize(messages: list[dict]) -> list[int]:
    r = post(
        BASELINE + "/tokenize",
        {"model": MODEL, "messages": messages, "add_generation_prompt": True},
    )
    return r["tokens"]


def test_transferred_blocks_are_published(replicas, events):
    a = replicas[0]
    messages = [{"role": "user", "content": model_task.examples(4242, [300])[0].prompt}]
    ids = tokenize(messages)
    full = [tuple(ids[i * BLOCK : (i + 1) * BLOCK]) for i in range(len(ids) // BLOCK)]
    assert len(full) >= 4, f"prompt of {len(ids)} tokens: too short for the check"

    t0 = time.monotonic()
    d_before = sources(DECODES)
    got, _ = chat(
        a.url, messages
    )  # no conversation_id: prefill, then the decode pulls the prompt
    d_after = sources(DECODES)
    want, busage = chat(BASELINE, messages)
    assert got == want
    assert int(busage["prompt_tokens"]) == len(ids), (
        "the baseline's prompt is not the tokenized one"
    )
    pulled = d_after[1] - d_before[1]
    assert pulled >= (len(full) - 1) * BLOCK, (
        f"the decodes pulled {pulled:.0f} prompt tokens: the prompt did not arrive by transfer"
    )

    decodes = {n for n in EVENTS if n.startswith("decode")}
    deadline = time.monotonic() + 15
    while True:
        # The decodes' blocks of this prompt published since the request;
        # every block of it they ever published (a block cached earlier is
        # not published again); the baseline's since the request.
        dec_prompt = {
            h: v for h, v in events.blocks(t0, decodes).items() if v[1] in full
        }
        dec_all = {h: v for h, v in events.blocks(0, decodes).items() if v[1] in full}
        base_prompt = {
            h: v[1] for h, v in events.blocks(t0, {"baseline"}).items() if v[1] in full
        }
        if (
            len(base_prompt) >= len(full) - 1
            and len(dec_prompt) >= len(full) - 1
            and set(base_prompt) <= set(dec_all)
        ):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    publishers = sorted({v[0] for v in dec_prompt.values()})
    print(
        f"prompt of {len(ids)} tokens ({len(full)} full blocks), pulled by a decode ({pulled:.0f} tokens): "
        f"the decodes published {len(dec_prompt)} of its blocks as BlockStored ({publishers}), the baseline "
        f"{len(base_prompt)}; batches received {events.batches}, undecodable {events.errors[:3]}"
    )
    assert len(base_prompt) >= len(full) - 1, (
        f"the baseline published {len(base_prompt)} of the prompt's {len(full)} blocks (its first may be a cached template block)"
    )
    assert len(dec_prompt) >= len(full) - 1, (
        f"the decodes published {len(dec_prompt)} of the prompt's {len(full)} blocks after receiving it by transfer"
    )
    missing = set(base_prompt) - set(dec_all)
    assert not missing, (
        f"{len(missing)} of the prompt's blocks the baseline published (by computing) were not published by a decode "
        f"that received them by transfer"
    )
    for h, toks in base_prompt.items():
        assert dec_all[h][1] == toks, (
            f"block hash {h}: the decode's tokens differ from the baseline's"
        )
    assert len(publishers) == 1, (
        f"more than one decode published the prompt: {publishers}"
    )
