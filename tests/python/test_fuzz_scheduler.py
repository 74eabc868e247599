"""Hypothesis fuzz of GoNixlConnector's SCHEDULER entry points with vLLM's
real objects (VllmConfig, KVCacheConfig, Request, KVCacheBlocks,
SchedulerOutput, KVConnectorOutput; tests/python/connector_harness.py).

kv_transfer_params arrive from HTTP clients (through a proxy, or straight
at an instance) as JSON: every key can hold any JSON-like value. For each
example, one request goes through the calls vLLM's scheduler makes, in its
order: on_new_request, get_num_new_matched_tokens (asked again while the
request waits), update_state_after_alloc (or no allocation), build_connector_meta,
update_connector_output, request_finished, build_connector_meta.

The contract checked (gonixl/vllm.py: "bad kv_transfer_params fail that
request's transfer with a log line, never the engine"):

- no exception escapes any entry point: unusable params are dropped and the
  prompt is computed locally;
- get_num_new_matched_tokens returns (n, async) with 0 <= n <= prompt tokens
  - locally computed tokens (vLLM asserts computed + external <= num_tokens;
  like vLLM's NixlConnector a remote prefill may supply every prompt token,
  the scheduler recomputes the last one), and async exactly when n > 0;
- a request that was told to wait for remote KV (async) gets a READ in the
  next step's metadata, with exactly its newly allocated blocks as the
  local side -- otherwise it would wait for KV that no one sends;
- every local block id in the built metadata belongs to the request it is
  listed for, and every entry not waiting for KV reads nothing;
- request_finished returns (bool, None or a JSON dict) whose block ids are
  the request's blocks, and whose params a decode accepts;
- the library is not poisoned: after every example a well-formed remote
  prefill is still accepted and scheduled.

Regular runs: 200 examples, derandomized (reproducible in CI). Long run:
  GONIXL_FUZZ_EXAMPLES=5000 .venv/bin/python -m pytest -q tests/python/test_fuzz_scheduler.py
(GONIXL_FUZZ_RANDOM=1 for a fresh random seed instead of the fixed one.)
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import struct
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

if importlib.util.find_spec("vllm") is None:  # pragma: no cover - environment
    pytest.skip("vLLM is not installed in this interpreter (use .venv/bin/python)", allow_module_level=True)
hypothesis = pytest.importorskip("hypothesis")

import msgspec  # noqa: E402  (a vLLM dependency)
from hypothesis import HealthCheck, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import connector_harness as h  # noqa: E402  (imports vLLM)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

EXAMPLES = int(os.environ.get("GONIXL_FUZZ_EXAMPLES", "200"))
RANDOM = os.environ.get("GONIXL_FUZZ_RANDOM") == "1"
NUM_BLOCKS = 96  # each scheduler's block pool (block 0 is vLLM's null block)
BS = h.BLOCK_SIZE
MAX_TOKENS = h.MAX_MODEL_LEN
THRESHOLD = 48  # kv_recompute_threshold of the bidirectional engines


def _connector_class(lib_path: str):
    os.environ["GONIXL_LIB_PATH"] = lib_path
    import gonixl

    if importlib.util.find_spec("gonixl.vllm") is None:
        gonixl.__path__.append(os.path.join(h.ROOT, "pybridge", "gonixl"))
    from gonixl.vllm import GoNixlConnector

    return GoNixlConnector


class Sched:
    """One engine's SCHEDULER-role connector (no worker, no network: the
    side-channel listener starts only with a handshake payload)."""

    def __init__(self, cls, kv_role: str, engine_id: str, extra: dict):
        self.engine_id = engine_id
        self.kv_role = kv_role
        self.bidirectional = bool(extra.get("bidirectional_kv_xfer"))
        self.vllm_config = h.make_vllm_config(kv_role, engine_id, extra)
        # As the EngineCore does: resolve the layout, then size the cache.
        layout = h.resolve_layout_cpu(self.vllm_config)
        self.kv_cache_config = h.make_kv_cache_config(self.vllm_config, NUM_BLOCKS)
        self.kv_cache_config.kv_cache_layout = layout.name
        with h.set_current_vllm_config(self.vllm_config):
            self.conn = cls(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
        self.free = list(range(1, NUM_BLOCKS))
        self.owner: dict[int, str] = {}  # block id -> request id holding it

    def alloc(self, rid: str, n: int) -> list:
        assert len(self.free) >= n
        ids, self.free = self.free[:n], self.free[n:]
        for b in ids:
            self.owner[b] = rid
        return [h.KVCacheBlock(block_id=i, ref_cnt=1) for i in ids]

    def release(self, ids) -> None:
        for b in ids:
            self.owner.pop(b, None)
        self.free.extend(ids)

    def meta(self) -> dict:
        """build_connector_meta, decoded (the Go msgpack inside the opaque
        metadata object, after the pickling vLLM does to reach workers)."""
        import pickle

        m = pickle.loads(pickle.dumps(self.conn.build_connector_meta(SchedulerOutput.make_empty())))
        if not m.data:  # an idle step: the same as a step with nothing in it
            return {"reqs_to_recv": {}, "reqs_to_send": {}, "reqs_in_batch": [], "reqs_not_processed": [], "heartbeats": None}
        env = msgspec.msgpack.decode(m.data)
        assert env["v"] == 2 and isinstance(env["m"], dict), env
        for rr in (env["m"].get("reqs_to_recv") or {}).values():
            if rr is not None:
                rr["local_block_ids"] = _block_ids(rr.get("local_block_ids"))
                if rr.get("remote") is not None:
                    rr["remote"]["block_ids"] = _block_ids(rr["remote"].get("block_ids"))
        return env["m"]


def _block_ids(groups):
    """Step metadata version 2 carries each group's block ids as one bin
    blob of little-endian int64s (shim/stepmeta.go)."""
    if groups is None:
        return None
    out = []
    for g in groups:
        assert isinstance(g, (bytes, bytearray)) and len(g) % 8 == 0, g
        out.append(list(struct.unpack(f"<{len(g) // 8}q", g)))
    return out


@pytest.fixture(scope="module")
def scheds(lib_path):
    cls = _connector_class(lib_path)
    out = {}
    try:
        for name, role, extra in [
            ("decode", "kv_consumer", {}),
            ("prefill", "kv_producer", {}),
            ("bidir_decode", "kv_consumer", {"bidirectional_kv_xfer": True, "kv_recompute_threshold": THRESHOLD}),
            ("bidir_prefill", "kv_producer", {"bidirectional_kv_xfer": True, "kv_recompute_threshold": THRESHOLD}),
        ]:
            out[name] = Sched(cls, role, f"fuzz-{name}", {"transfer_engine": "ucx", **extra})
        yield out
    finally:
        for s in out.values():
            s.conn.shutdown()


# ----------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------

PROMPT = object()  # placeholder: the prompt's token count
DIGEST = object()  # placeholder: the correct gonixl_prompt_digest
BLOCKS = object()  # placeholder: one plausible remote block id per prompt block

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_leaf, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=6), ch, max_size=4), max_leaves=12
)

garbage_int = st.one_of(
    st.integers(-3, 2**21),
    st.integers(2**31 - 2, 2**31 + 2),
    st.integers(2**62, 2**70),
    st.integers(-(2**70), -1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([True, False, "1", "", None, [], {}, [1]]),
)
block_id = st.one_of(st.integers(0, NUM_BLOCKS + 4), garbage_int, st.text(max_size=3))


def _big_list(n: int, kind: str):
    if kind == "range":
        return list(range(n))
    if kind == "same":
        return [7] * n
    if kind == "nested":
        return [list(range(n))]
    if kind == "negative_tail":
        return list(range(n)) + [-1]
    if kind == "groups":
        return [[1]] * n
    return [2**70] * n


remote_block_ids = st.one_of(
    st.just(BLOCKS),
    st.lists(st.integers(0, NUM_BLOCKS + 4), max_size=40),
    st.lists(st.lists(st.integers(0, NUM_BLOCKS + 4), max_size=40), min_size=1, max_size=3),
    st.lists(block_id, max_size=8),
    st.lists(st.lists(block_id, max_size=5), max_size=3),
    st.lists(st.one_of(block_id, st.lists(block_id, max_size=3)), max_size=5),
    st.builds(_big_list, st.integers(0, 100_000), st.sampled_from(["range", "same", "nested", "negative_tail", "groups", "huge"])),
    json_values,
)
bool_like = st.one_of(st.booleans(), st.none(), st.sampled_from([0, 1, 2, 1.0, "true", "false", "", [], {}, [True]]), json_values)
text_like = st.one_of(st.text(max_size=30), st.just(""), st.none(), json_values)
host_like = st.one_of(st.sampled_from(["127.0.0.1", "localhost", "::1", "", "0.0.0.0"]), st.text(max_size=30), json_values)
port_like = st.one_of(st.integers(0, 65535), garbage_int, st.text(max_size=6))
size_like = st.one_of(st.just(1), garbage_int)
tokens_like = st.one_of(st.just(PROMPT), st.integers(-5, MAX_TOKENS + 5), garbage_int)
expiry_like = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70), st.none(), st.text(max_size=5))
digest_like = st.one_of(st.just(DIGEST), st.text(max_size=40), json_values)

KEY_STRATEGIES = {
    "do_remote_prefill": bool_like,
    "do_remote_decode": bool_like,
    "remote_block_ids": remote_block_ids,
    "remote_engine_id": st.one_of(st.just("fuzz-remote"), text_like),
    "remote_request_id": st.one_of(st.just("remote-req"), text_like),
    "remote_host": host_like,
    "remote_port": port_like,
    "tp_size": size_like,
    "dcp_size": size_like,
    "pp_size": size_like,
    "remote_block_size": size_like,
    "remote_num_tokens": tokens_like,
    "remote_blocks_expiry_time": expiry_like,
    "_remote_blocks_processed": bool_like,
    "transfer_mode": st.one_of(st.just("pull"), text_like),
    "gonixl_prompt_digest": digest_like,
}

# Well-formed params of each kind a proxy sends; examples mutate them.
BASES = {
    "remote_prefill": {  # a prefill's output, as the decode receives it
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": BLOCKS,
        "remote_engine_id": "fuzz-remote",
        "remote_request_id": "remote-req",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": PROMPT,
        "remote_blocks_expiry_time": 1e9,
        "transfer_mode": "pull",
        "gonixl_prompt_digest": DIGEST,
    },
    "proxy_prefill": dict(h.PROXY_PREFILL_PARAMS),  # what the toy proxy sends a prefill
    "bidir_pullback": {  # a later turn at a bidirectional prefill: pull the decode's KV back
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_block_ids": BLOCKS,
        "remote_engine_id": "fuzz-remote",
        "remote_request_id": "remote-req",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "tp_size": 1,
        "remote_num_tokens": PROMPT,
    },
    "empty": {},
}


@st.composite
def scenario(draw):
    sched = draw(st.sampled_from(["decode", "prefill", "bidir_decode", "bidir_prefill"]))
    n = draw(st.integers(1, MAX_TOKENS))
    base = draw(st.sampled_from(sorted(BASES)))
    params = dict(BASES[base])
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.sampled_from(sorted(KEY_STRATEGIES)))
        if draw(st.integers(0, 5)) == 0:
            params.pop(key, None)
        else:
            params[key] = draw(KEY_STRATEGIES[key])
    params.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)))
    if draw(st.integers(0, 30)) == 0:
        params = draw(st.sampled_from([None, {}]))
    return {
        "sched": sched,
        "n": n,
        "base": base,
        "params": params,
        # vLLM's local prefix hit is whole blocks and never the whole prompt.
        "hit": draw(st.integers(0, (n - 1) // BS)),
        "asks": draw(st.integers(1, 3)),  # get_num_new_matched_tokens calls while waiting
        "alloc_fails": draw(st.integers(0, 9)) == 0,
        "finish": draw(st.sampled_from(["length", "stopped", "aborted", "aborted_before_alloc"])),
        "noise_ids": draw(st.lists(st.text(max_size=12), max_size=3)),
        # Preempted after its first step and scheduled again (vLLM frees its
        # blocks and asks the connector again, with the params as mutated).
        "preempt": draw(st.integers(0, 5)) == 0,
    }


def _resolve(params, n: int, prompt_ids):
    """Replace the placeholders with values for this prompt."""
    import gonixl.vllm as gv

    if params is None:
        return None
    nb = h.cdiv(n, BS)
    out = {}
    for k, v in params.items():
        if v is PROMPT:
            v = n
        elif v is BLOCKS:
            v = [list(range(1, nb + 1))]
        out[k] = v
    for k, v in out.items():
        if v is DIGEST:
            rn = out.get("remote_num_tokens")
            out[k] = gv.prompt_digest(prompt_ids, rn) if isinstance(rn, int) else "blake2b-128:00"
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_counter = iter(range(10**9))

# Two scheduler bugs this fuzz found in shim/scheduler.go, fixed, with Go
# regression tests (shim/fuzz_test.go TestSchedulerNoNilRecvEntry and
# TestSchedulerAsyncImpliesRead): a nil reqs_to_recv entry for a request
# aborted with unusable params, and (n > 0, async) answered for params
# UpdateStateAfterAlloc schedules no READ for. Both are plain failures here.


# ----------------------------------------------------------------------
# the property
# ----------------------------------------------------------------------


def check_meta(s: Sched, m: dict, allocated: dict[str, set[int]]) -> dict:
    """Every reqs_to_recv entry reads only blocks of its own request."""
    recv = m.get("reqs_to_recv") or {}
    for rid, rr in list(recv.items()):
        assert rr is not None, f"reqs_to_recv[{rid!r}] is nil"
        local = [b for g in (rr.get("local_block_ids") or []) for b in g]
        if not rr.get("awaiting_kvs"):
            assert local == [], f"{rid}: not awaiting KV but reads into {local}"
        mine = allocated.get(rid, set())
        for b in local:
            assert _is_int(b) and 1 <= b < NUM_BLOCKS, f"{rid}: local block id {b!r}"
            assert b in mine, f"{rid}: local block {b} is not one of its blocks {sorted(mine)}"
        for g in (rr.get("remote") or {}).get("block_ids") or []:
            for b in g:
                assert _is_int(b) and b >= 0, f"{rid}: remote block id {b!r}"
    for rid, exp in (m.get("reqs_to_send") or {}).items():
        assert isinstance(exp, float) and math.isfinite(exp), (rid, exp)
    for eng, hb in (m.get("heartbeats") or {}).items():
        assert hb is not None and 0 <= hb["port"] <= 65535 and all(isinstance(x, str) for x in hb["req_ids"]), (eng, hb)
    return recv


def well_formed_still_works(s: Sched) -> None:
    """The library is not poisoned: a correct remote prefill is accepted,
    scheduled and cleaned up."""
    if s.kv_role != "kv_consumer":
        return
    rid = f"sanity-{next(_counter)}"
    n = 3 * BS + 5
    req = h.Engine.request(rid, n, None)
    params = _resolve(BASES["remote_prefill"], n, req.prompt_token_ids)
    req.kv_transfer_params = params
    s.conn.on_new_request(req)
    assert s.conn.get_num_new_matched_tokens(req, 0) == (n, True)
    blocks = s.alloc(rid, h.cdiv(n, BS))
    s.conn.update_state_after_alloc(req, KVCacheBlocks((blocks,)), n)
    recv = s.meta()["reqs_to_recv"]
    assert recv[rid]["local_block_ids"] == [[b.block_id for b in blocks]], recv.get(rid)
    s.conn.update_connector_output(KVConnectorOutput(finished_recving={rid}))
    req.status = RequestStatus.FINISHED_STOPPED
    delay, out = s.conn.request_finished(req, [b.block_id for b in blocks])
    if s.bidirectional:
        # A bidirectional decode holds the blocks for the next turn.
        assert delay is True and out["do_remote_decode"] is True and out["remote_block_ids"] == [[b.block_id for b in blocks]], out
    else:
        assert (delay, out) == (False, None)
    s.release([b.block_id for b in blocks])
    s.meta()


def run_scenario(scheds: dict[str, Sched], sc: dict) -> None:
    s = scheds[sc["sched"]]
    n = sc["n"]
    rid = f"fz-{next(_counter)}"
    req = h.Engine.request(rid, n, None, max_tokens=4)
    req.kv_transfer_params = _resolve(sc["params"], n, req.prompt_token_ids)
    # Keep a copy for the failure message; the connector may mutate the dict.
    sent = copy.deepcopy(req.kv_transfer_params)
    allocated: dict[str, set[int]] = {}
    held: list[int] = []
    try:
        s.conn.on_new_request(req)
        hit_blocks = h.Engine.cached_blocks(s.alloc(rid, sc["hit"]), rid.encode()) if sc["hit"] else []
        held += [b.block_id for b in hit_blocks]
        computed = sc["hit"] * BS
        results = []
        for _ in range(sc["asks"]):
            got = s.conn.get_num_new_matched_tokens(req, computed)
            assert isinstance(got, tuple) and len(got) == 2, got
            ext, is_async = got
            assert _is_int(ext) and isinstance(is_async, bool), got
            assert 0 <= ext <= n - computed, f"{ext} external tokens for a {n}-token prompt with {computed} computed"
            assert is_async == (ext > 0), got
            results.append(got)
        assert all(r == results[0] for r in results), f"answers changed while waiting: {results}"
        ext, is_async = results[0]
        event(f"get_num_new_matched_tokens: {'async load' if is_async else 'computed locally'}")
        if sc["finish"] == "aborted_before_alloc" or sc["alloc_fails"]:
            # allocate_slots failed (or the client went away) before the
            # request was scheduled: it is finished without allocation.
            req.status = RequestStatus.FINISHED_ABORTED
            delay, out = s.conn.request_finished(req, [b.block_id for b in hit_blocks])
            assert (delay, out) == (False, None) or isinstance(out, dict), (delay, out)
            check_meta(s, s.meta(), {rid: set(held)})
            return
        new = s.alloc(rid, h.cdiv(n, BS) - len(hit_blocks))
        held += [b.block_id for b in new]
        allocated[rid] = set(held)
        s.conn.update_state_after_alloc(req, KVCacheBlocks((hit_blocks + new,)), ext)
        if is_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            req.num_computed_tokens = computed + ext
        m = s.meta()
        recv = check_meta(s, m, allocated)
        if is_async:
            # Told to wait for remote KV: the READ must be in this step's
            # metadata, into exactly the newly allocated blocks.
            event("READ scheduled")
            assert rid in recv, f"async load of {ext} tokens but no READ scheduled for {sent!r}"
            assert recv[rid]["awaiting_kvs"] is True
            assert recv[rid]["local_block_ids"] == [[b.block_id for b in new]], recv[rid]
            done = KVConnectorOutput(finished_recving={rid, *sc["noise_ids"]})
        else:
            done = KVConnectorOutput(finished_recving=set(sc["noise_ids"]) or None)
        s.conn.update_connector_output(done)
        if sc["preempt"]:
            event("preempted and rescheduled")
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            s.release(held)
            held = []
            ext, is_async = s.conn.get_num_new_matched_tokens(req, 0)
            assert _is_int(ext) and 0 <= ext <= n and is_async == (ext > 0), (ext, is_async)
            new = s.alloc(rid, h.cdiv(n, BS))
            held = [b.block_id for b in new]
            allocated[rid] = set(held)
            s.conn.update_state_after_alloc(req, KVCacheBlocks((new,)), ext)
            recv = check_meta(s, s.meta(), allocated)
            if is_async:
                assert rid in recv, f"rescheduled: async load of {ext} tokens but no READ for {sent!r}"
                assert recv[rid]["local_block_ids"] == [held], recv[rid]
        req.num_computed_tokens = n
        req.status = {
            "length": RequestStatus.FINISHED_LENGTH_CAPPED,
            "stopped": RequestStatus.FINISHED_STOPPED,
            "aborted": RequestStatus.FINISHED_ABORTED,
        }[sc["finish"]]
        delay, out = s.conn.request_finished(req, held)
        event(f"request_finished: delay={delay}, params={'yes' if out else 'no'}")
        assert isinstance(delay, bool), delay
        assert out is None or isinstance(out, dict), out
        if out is not None:
            json.loads(json.dumps(out, allow_nan=False))  # plain JSON for the HTTP response
            assert out["remote_engine_id"] == s.engine_id
            assert out["remote_request_id"] == rid
            assert 0 < out["remote_port"] <= 65535
            if delay:
                assert out["remote_block_ids"] == [held], (out["remote_block_ids"], held)
        if delay:
            assert sc["finish"] != "aborted" and held, (delay, sc["finish"])
            # A decode accepts the params this engine hands out.
            d = scheds["decode"]
            if out.get("do_remote_prefill"):
                dreq = h.Engine.request(f"{rid}-next", n, out)
                assert d.conn.get_num_new_matched_tokens(dreq, 0) == (n, True)
        check_meta(s, s.meta(), allocated)
    except BaseException as e:
        raise AssertionError(f"scenario {sc['sched']} n={n} base={sc['base']} params={sent!r}") from e
    finally:
        s.release(held)


def run_and_check(scheds: dict[str, Sched], sc: dict) -> None:
    try:
        run_scenario(scheds, sc)
    finally:
        # Whatever the example did, the library still serves a good request.
        well_formed_still_works(scheds["decode"])


def _example(sched: str, base: str, n: int = 64, alloc_fails: bool = False, drop=(), **changes) -> dict:
    params = {k: v for k, v in BASES[base].items() if k not in drop}
    params.update(changes)
    return {"sched": sched, "n": n, "base": base, "params": params, "hit": 0, "asks": 1, "alloc_fails": alloc_fails,
            "finish": "stopped", "noise_ids": [], "preempt": False}


@example(sc=_example("decode", "remote_prefill"))  # the well-formed case
@example(sc=_example("decode", "remote_prefill", alloc_fails=True, drop=("remote_engine_id",)))  # nil_recv_entry
@example(sc=_example("decode", "remote_prefill", remote_request_id=""))  # async_without_read
@example(sc=_example("decode", "remote_prefill", remote_request_id=None))  # async_without_read
@example(sc=_example("decode", "bidir_pullback"))  # async_without_read: not bidirectional
@example(sc=_example("bidir_prefill", "bidir_pullback", _remote_blocks_processed=True))  # async_without_read
@example(sc=_example("bidir_prefill", "bidir_pullback"))  # the well-formed pull-back
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sc=scenario())
def test_scheduler_survives_adversarial_kv_transfer_params(scheds, sc):
    run_and_check(scheds, sc)


def test_fuzz_run_summary(scheds):
    """The schedulers still work after the fuzzing, and report how many
    examples ran (for the long-run record)."""
    for s in scheds.values():
        well_formed_still_works(s)
        assert sorted(s.free) == list(range(1, NUM_BLOCKS)), f"{s.engine_id}: blocks leaked by the test itself"
    print(
        f"\ngonixl scheduler fuzz: {EXAMPLES} examples per run (derandomize={not RANDOM}), {next(_counter)} requests"
    )


def test_rejected_request_stand_in_is_not_a_prompt_mismatch(scheds, caplog):
    """vLLM's server, rejecting a request before its engine sees it, submits
    a stand-in (prompt [0], aborted at once: notify_kv_transfer_request_rejected)
    with the client's kv_transfer_params. Its prompt cannot match the
    prefill's digest; that is logged as a rejection, not as KV of another
    prompt, and nothing is read for it."""
    s = scheds["decode"]
    n = 3 * BS + 5
    real = h.Engine.request("real-prompt", n, None)
    params = _resolve(BASES["remote_prefill"], n, real.prompt_token_ids)
    for rid, abort_immediately, want in [
        ("rejected-0", True, "rejected before it reached the engine"),
        ("mismatch-0", False, "hold the KV of another prompt"),
    ]:
        req = h.Engine.request(rid, 1, None, max_tokens=1)
        req.abort_immediately = abort_immediately
        req.kv_transfer_params = copy.deepcopy(params)
        caplog.clear()
        with caplog.at_level("INFO"):
            s.conn.on_new_request(req)
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if "GoNixlConnector" in r.getMessage()]
        assert len(lines) == 1 and want in lines[0][1], lines
        assert lines[0][0] == ("INFO" if abort_immediately else "ERROR"), lines
        assert req.kv_transfer_params["do_remote_prefill"] is False
        assert not any(k.startswith("remote_") for k in req.kv_transfer_params), req.kv_transfer_params
        assert s.conn.get_num_new_matched_tokens(req, 0) == (0, False)
        req.status = RequestStatus.FINISHED_ABORTED
        assert s.conn.request_finished(req, []) == (False, None)
        assert rid not in (s.meta().get("reqs_to_recv") or {})
