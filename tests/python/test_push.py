"""GoNixlPushConnector (vLLM's push mode) driven through vLLM's scheduler and
worker call sequence, with vLLM's real objects and KV tensors, two engines
in this process moving KV through real UCX (gonixl's ucx engine) and real
NIXL where it loads (tests/python/connector_harness.py).

The decode registers its blocks (PUSH_REG), the prefill WRITEs into them:
checked in both orders of the race, byte for byte, with vLLM's request ids
("<client id>-<8 hex>" on each side); a decode whose prompt differs is not
written; has_pending_push_work keeps the engines stepping while work is
pending; a registration nobody answers fails at push_registration_timeout.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

# vLLM and both engines are installed wherever these tests run: missing,
# they fail, they do not skip.
if importlib.util.find_spec("vllm") is None:  # pragma: no cover - environment
    raise ImportError("vLLM is not installed in this interpreter (use .venv/bin/python)")

import connector_harness as h  # noqa: E402  (imports vLLM)
from test_connector import _engine_unavailable, assert_blocks_copied, assert_kv_unchanged, dist_env  # noqa: E402,F401

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

P_BLOCKS, D_BLOCKS = 40, 56


def _push_class(lib_path: str):
    os.environ["GONIXL_LIB_PATH"] = lib_path
    import gonixl

    if importlib.util.find_spec("gonixl.vllm") is None:
        gonixl.__path__.append(os.path.join(h.ROOT, "pybridge", "gonixl"))
    from gonixl.vllm import GoNixlPushConnector

    return GoNixlPushConnector


@pytest.fixture(scope="module", params=["ucx", "nixl"])
def pd(request, lib_path, dist_env):  # noqa: F811  (dist_env: the fixture imported above)
    cls = _push_class(lib_path)
    why = _engine_unavailable(request.param)
    if why:
        pytest.fail(f"gonixl's {request.param} transfer engine does not load on this host: {why}")
    extra = {"transfer_engine": request.param, "push_registration_timeout": 2, "kv_lease_duration": 30}
    engines = []
    try:
        p = h.Engine(cls, "kv_producer", f"push-prefill-{request.param}", P_BLOCKS, extra=extra)
        engines.append(p)
        d = h.Engine(cls, "kv_consumer", f"push-decode-{request.param}", D_BLOCKS, extra=extra)
        engines.append(d)
        p.fill_all(-7.0)
        d.fill_all(-3.0)
        yield p, d
    finally:
        for e in engines:
            e.shutdown()


def proxy_params(p: h.Engine, client_id: str) -> dict:
    """What a proxy that sends to both sides at once gives the decode: the
    prefill's identity, known before it answered."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": p.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": 1,
        "remote_request_id": client_id,
    }


def decode_push(d: h.Engine, req_id: str, num_tokens: int, params: dict, local_hit_blocks: int = 0, tokens_offset: int = 0) -> h.DecodeReq:
    req = d.request(req_id, num_tokens, copy.deepcopy(params), max_tokens=4)
    if tokens_offset:
        req.prompt_token_ids[:] = [(t + tokens_offset) % 60 for t in req.prompt_token_ids]
    d.add_request(req)
    return h.schedule_decode(d, req_id, num_tokens, params, local_hit_blocks, queued=req)


@pytest.mark.parametrize("order", ["prefill first", "registration first"])
def test_push_moves_the_prompt_in_either_order(pd, order):
    p, d = pd
    tag = order.split()[0]
    pid, did = f"cmpl-{tag}-0-1a2b3c4d", f"cmpl-{tag}-0-5e6f7a8b"
    n = 3 * h.BLOCK_SIZE + 5
    before = d.snapshot()
    if order == "prefill first":
        pre = h.prefill(p, pid, n, seed=11)
        assert pre.delay is True
        assert pre.params["transfer_mode"] == "push" and "remote_blocks_expiry_time" not in pre.params, pre.params
        assert p.sched.has_pending_push_work()
        dr = decode_push(d, did, n, pre.params, local_hit_blocks=1)
    else:
        dr = decode_push(d, did, n, proxy_params(p, f"cmpl-{tag}-0"), local_hit_blocks=1)
        assert dr.load_async and dr.n_ext == n - h.BLOCK_SIZE
        assert d.sched.has_pending_push_work()  # the registration is not yet with the worker
        h.run_steps([d, p], 5)
        pre = h.prefill(p, pid, n, seed=12)
    h.run_until([p, d], lambda: did in d.out.recving and pid in p.out.sending, f"push of {pid} into {did}")
    assert did not in d.out.failed
    # The decode's prefix hit kept its block; the rest is the prefill's tail.
    src = pre.block_ids[1:]
    assert_blocks_copied(p, d, src, dr.new_blocks, _with(before, d, dr.local_hit))
    assert not p.sched.has_pending_push_work() and not d.sched.has_pending_push_work()
    d.free(dr.local_hit + dr.new_blocks)


def _with(before: dict, d: h.Engine, hit: list[int]) -> dict:
    """before, with the prefix-hit blocks as they are now (the harness
    allocated them after the snapshot; they are not written by the push)."""
    out = {}
    dim = 1 if d.kv_shape == "flash_attn" else 0
    for name, t in before.items():
        t = t.clone()
        for b in hit:
            t.select(dim, b).copy_(d.kv_caches[name].select(dim, b))
        out[name] = t
    return out


def test_push_to_a_decode_with_another_prompt_is_refused(pd):
    """Same request id, different prompt tokens: the prefill refuses to
    WRITE (gonixl's prompt digest in the registration), the decode fails."""
    p, d = pd
    pid, did = "cmpl-other-0-1a2b3c4d", "cmpl-other-0-5e6f7a8b"
    n = 2 * h.BLOCK_SIZE + 3
    pre = h.prefill(p, pid, n, seed=13)
    before = d.snapshot()
    params = {k: v for k, v in pre.params.items() if k != "gonixl_prompt_digest"}
    dr = decode_push(d, did, n, params, tokens_offset=1)
    h.run_until([p, d], lambda: did in d.out.failed and did in d.out.recving, f"refused push into {did}")
    assert_kv_unchanged(d, before)
    h.run_until([p, d], lambda: pid in p.out.sending, f"prefill frees {pid}")
    d.free(dr.new_blocks)


def test_unanswered_registration_fails_at_the_timeout(pd):
    """No prefill request ever finishes for this registration: the decode
    fails it at push_registration_timeout (2 s here) and gives its blocks
    back once the (gonixl) prefill confirmed it will not write."""
    p, d = pd
    did = "cmpl-orphan-0-5e6f7a8b"
    dr = decode_push(d, did, h.BLOCK_SIZE + 1, proxy_params(p, "cmpl-orphan-0"))
    h.run_for([p, d], 1.0)
    assert did not in d.out.failed and did not in d.out.recving
    h.run_until([p, d], lambda: did in d.out.failed and did in d.out.recving, f"timeout of {did}", timeout=15)
    d.free(dr.new_blocks)


def test_bidirectional_push_is_refused(lib_path, dist_env):  # noqa: F811
    cls = _push_class(lib_path)
    with pytest.raises(NotImplementedError, match="Bidirectional KV transfer is not supported for NIXL push connector."):
        h.Engine(cls, "kv_producer", "push-bidir", 8, extra={"transfer_engine": "ucx", "bidirectional_kv_xfer": True})


def test_aborted_decode_request_is_not_registered(pd):
    """A decode request aborted before allocation registers nothing (the
    prefill frees its blocks at its lease, as vLLM's push connector)."""
    p, d = pd
    req = d.request("cmpl-gone-0-5e6f7a8b", 10, proxy_params(p, "cmpl-gone-0"))
    d.add_request(req)
    req.status = RequestStatus.FINISHED_ABORTED
    assert d.sched.request_finished(req, []) == (False, None)
    assert not d.sched.has_pending_push_work()
    d.sched.update_state_after_alloc(req, KVCacheBlocks(([],)), 0)
    assert not d.sched.has_pending_push_work()


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED])
def test_push_writes_once_the_prompt_is_computed(pd, status):
    """The prefill WRITEs as soon as the step that completes a max_tokens=1
    prompt has run, before vLLM finishes the request (the decode has its KV
    with the prefill still holding the request); the blocks are freed only
    after request_finished, which holds them whatever its status (an abort
    after the prompt was computed still leaves whole KV being read)."""
    p, d = pd
    tag = status.name.split("_")[-1].lower()
    pid, did = f"cmpl-early{tag}-0-1a2b3c4d", f"cmpl-early{tag}-0-5e6f7a8b"
    n = 2 * h.BLOCK_SIZE + 3
    before = d.snapshot()
    dr = decode_push(d, did, n, proxy_params(p, f"cmpl-early{tag}-0"))
    h.run_steps([d, p], 5)  # the registration reaches the prefill
    req = p.request(pid, n, dict(h.PROXY_PREFILL_PARAMS))
    p.add_request(req)
    assert p.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    blocks = p.alloc(h.cdiv(n, p.block_size))
    p.sched.update_state_after_alloc(req, KVCacheBlocks((blocks,)), 0)
    req.status = RequestStatus.RUNNING
    ids = [b.block_id for b in blocks]
    for b in ids:
        p.fill_block(b, 21.0)
    p.scheduling.append((pid, ids, n))
    p.step()  # the forward that completes the prompt
    h.run_until([p, d], lambda: did in d.out.recving, f"early push into {did}")
    assert did not in d.out.failed
    assert_blocks_copied(p, d, ids, dr.new_blocks, _with(before, d, []))
    assert pid not in p.out.sending, "finished_sending before request_finished: vLLM would free a running request's blocks"
    req.num_computed_tokens = n
    req.status = status
    delay, _ = p.sched.request_finished(req, ids)
    assert delay is True
    p.held[pid] = ids
    p.finished_req_ids.add(pid)
    h.run_until([p, d], lambda: pid in p.out.sending, f"prefill frees {pid}")
    assert not p.sched.has_pending_push_work()
    d.free(dr.new_blocks)


def test_admission_waits_for_the_decode_past_the_unclaimed_budget(lib_path, dist_env):  # noqa: F811
    """push_unclaimed_blocks 0: a prefill holding one unclaimed prompt
    defers the next push request (get_num_new_matched_tokens: None) until
    that request's decode registers; the registration reaches the scheduler
    from the prefill's worker through vLLM's worker metadata, and the
    request then goes, is computed and WRITTEN."""
    cls = _push_class(lib_path)
    extra = {"transfer_engine": "ucx", "push_registration_timeout": 5, "kv_lease_duration": 30, "push_unclaimed_blocks": 0}
    engines = []
    try:
        p = h.Engine(cls, "kv_producer", "admit-prefill", P_BLOCKS, extra=extra)
        engines.append(p)
        d = h.Engine(cls, "kv_consumer", "admit-decode", D_BLOCKS, extra=extra)
        engines.append(d)
        n = 2 * h.BLOCK_SIZE + 3
        held = h.prefill(p, "cmpl-a-0-1a2b3c4d", n, seed=21)  # nothing charged yet: it goes
        assert held.delay is True
        bid = "cmpl-b-0-2b3c4d5e"
        probe = p.request(bid, n, dict(h.PROXY_PREFILL_PARAMS))
        assert p.sched.get_num_new_matched_tokens(probe, 0) == (None, False)
        h.run_steps([p], 3)
        assert p.sched.get_num_new_matched_tokens(probe, 0) == (None, False), "admitted with no registration"
        before = d.snapshot()
        dr = decode_push(d, "cmpl-b-0-6f7a8b9c", n, proxy_params(p, "cmpl-b-0"))
        assert dr.load_async
        h.run_until([p, d], lambda: p.sched.get_num_new_matched_tokens(probe, 0) == (0, False), "the registration claims B")
        pre = h.prefill(p, bid, n, seed=22)
        h.run_until([p, d], lambda: "cmpl-b-0-6f7a8b9c" in d.out.recving and bid in p.out.sending, "push of B")
        assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
    finally:
        for e in engines:
            e.shutdown()
