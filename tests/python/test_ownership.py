"""Block ownership at the Python connector's edge, with vLLM's own objects
(Request, SchedulerOutput, KVCacheBlocks; tests/python/connector_harness.py):

- a bidirectional decode advertises only tokens whose KV is written
  (vLLM's async scheduling counts a step still in flight in
  num_computed_tokens; speculative decoding can run it past the token ids),
  and its token digest covers exactly those;
- a prefill given a gonixl decode's params without a token digest pulls
  nothing;
- push mode: a prompt announced for its early WRITE holds vLLM's preemption
  off (has_pending_block_frees) until its request_finished, and a
  preemption vLLM makes anyway goes to the workers in the step's metadata
  (push_preempted).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import msgspec  # noqa: E402  (a vLLM dependency)

import connector_harness as h  # noqa: E402  (imports vLLM)

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

NUM_BLOCKS = 64
BS = h.BLOCK_SIZE


def _classes(lib_path: str):
    os.environ["GONIXL_LIB_PATH"] = lib_path
    import gonixl

    if importlib.util.find_spec("gonixl.vllm") is None:
        gonixl.__path__.append(os.path.join(h.ROOT, "pybridge", "gonixl"))
    from gonixl import digest, vllm as gv

    return gv, digest


def _sched(gv, cls, kv_role: str, engine_id: str, extra: dict):
    vc = h.make_vllm_config(kv_role, engine_id, {"transfer_engine": "ucx", **extra})
    layout = h.resolve_layout_cpu(vc)  # as the EngineCore does, before sizing the cache
    kc = h.make_kv_cache_config(vc, NUM_BLOCKS)
    kc.kv_cache_layout = layout.name
    with h.set_current_vllm_config(vc):
        return cls(vc, KVConnectorRole.SCHEDULER, kc)


def _meta(conn, so: SchedulerOutput) -> dict:
    m = pickle.loads(pickle.dumps(conn.build_connector_meta(so)))
    if not m.data:
        return {}
    env = msgspec.msgpack.decode(m.data)
    return env["m"]


@pytest.fixture(scope="module")
def gv(lib_path):
    return _classes(lib_path)


def _finished_decode(n_prompt: int, n_out: int, in_flight: int, computed_extra: int = 0):
    """A decode request that generated n_out tokens and was finished while
    in_flight tokens of a later step were scheduled (async scheduling)."""
    req = h.Engine.request("dec-1", n_prompt, {"do_remote_prefill": False}, max_tokens=n_out)
    for i in range(n_out):
        req.append_output_token_ids((11 + i) % 60)
    # Sync scheduling finishes with every token but the last sampled one fed.
    written = n_prompt + n_out - 1
    req.num_computed_tokens = written + in_flight + computed_extra
    req.num_in_flight_tokens = in_flight
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return req, written


@pytest.mark.parametrize("in_flight, extra", [(0, 0), (1, 0), (3, 0), (0, 5)], ids=["sync", "async-1", "async-3", "spec-past-ids"])
def test_decode_advertises_only_written_tokens(gv, in_flight, extra):
    mod, digest = gv
    conn = _sched(mod, mod.GoNixlConnector, "kv_consumer", "own-bidir-d", {"bidirectional_kv_xfer": True})
    try:
        n_prompt, n_out = 2 * BS + 5, 7
        req, written = _finished_decode(n_prompt, n_out, in_flight, extra)
        blocks = list(range(1, h.cdiv(n_prompt + n_out, BS) + 2))
        delay, params = conn.request_finished_all_groups(req, (blocks,))
        assert delay and params, params
        want = min(written + extra, len(req.all_token_ids))
        assert params["remote_num_tokens"] == want, (params["remote_num_tokens"], want)
        d = params.get(digest.READBACK_DIGEST_KEY)
        assert d, f"no token digest for {want} tokens: a prefill would treat the decode as a stock one"
        # The digest vouches for exactly those tokens: a prompt of them
        # matches in full (up to the block-rounded checkpoints).
        matched = digest.matched_tokens(d, list(req.all_token_ids[:want]) + [1, 2, 3])
        assert matched == want, (matched, want)
    finally:
        conn.shutdown()


def test_gonixl_decode_params_without_digest_pull_nothing(gv, caplog):
    mod, _ = gv
    conn = _sched(mod, mod.GoNixlConnector, "kv_producer", "own-bidir-p", {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 1})
    try:
        n = 3 * BS
        params = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_block_ids": [list(range(1, 4))],
            "remote_engine_id": "dec",
            "remote_request_id": "dec-1",
            "remote_host": "127.0.0.1",
            "remote_port": 5999,
            "tp_size": 1,
            "remote_num_tokens": n,
            "gonixl_expiry_unix": time.time() + 300,
        }
        # The same params from a stock decode (no gonixl_expiry_unix) are
        # pulled unchecked, but for their last advertised token: vLLM's
        # decode counts a step in flight under async scheduling.
        stock = {k: v for k, v in params.items() if k != "gonixl_expiry_unix"}
        req = h.Engine.request("turn-2", n + BS, params)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        assert "carry no token digest" in caplog.text
        req2 = h.Engine.request("turn-2b", n + BS, stock)
        assert conn.get_num_new_matched_tokens(req2, 0) == (n - 1, True)
    finally:
        conn.shutdown()


def _prompt_step(req, new_block_ids, num_tokens, preempted=()):
    so = SchedulerOutput.make_empty()
    from types import SimpleNamespace

    so.scheduled_new_reqs.append(SimpleNamespace(req_id=req.request_id, block_ids=(list(new_block_ids),)))  # type: ignore[arg-type]
    so.num_scheduled_tokens[req.request_id] = num_tokens
    so.preempted_req_ids = set(preempted)
    return so


def test_push_announced_prompt_holds_preemption_off(gv):
    mod, _ = gv
    conn = _sched(mod, mod.GoNixlPushConnector, "kv_producer", "own-push-p", {})
    try:
        assert conn.has_pending_block_frees() is False
        n = 2 * BS + 3
        blocks = [h.KVCacheBlock(block_id=i, ref_cnt=1) for i in (4, 5, 6)]
        req = h.Engine.request("p-1", n, {"do_remote_decode": True})
        conn.update_state_after_alloc(req, KVCacheBlocks((blocks,)), 0)
        m = _meta(conn, _prompt_step(req, [4, 5, 6], n))
        assert "p-1" in (m.get("push_early") or {}), m
        assert conn.has_pending_block_frees() is True, "an announced prompt does not hold preemption off"
        # vLLM finishes it: preemption is allowed again.
        req.num_computed_tokens = n
        req.append_output_token_ids(7)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, _ = conn.request_finished_all_groups(req, ([4, 5, 6],))
        assert delay
        assert conn.has_pending_block_frees() is False
    finally:
        conn.shutdown()


def test_push_preemption_of_an_announced_prompt_reaches_the_workers(gv):
    mod, _ = gv
    conn = _sched(mod, mod.GoNixlPushConnector, "kv_producer", "own-push-p2", {})
    try:
        n = BS + 1
        req = h.Engine.request("p-2", n, {"do_remote_decode": True})
        conn.update_state_after_alloc(req, KVCacheBlocks(([h.KVCacheBlock(block_id=i, ref_cnt=1) for i in (8, 9)],)), 0)
        _meta(conn, _prompt_step(req, [8, 9], n))
        assert conn.has_pending_block_frees() is True
        # The next step's scheduling preempted it anyway (reset_prefix_cache).
        so = SchedulerOutput.make_empty()
        so.preempted_req_ids = {"p-2", "someone-else"}
        meta = pickle.loads(pickle.dumps(conn.build_connector_meta(so)))
        assert meta.preempted, "the step's metadata does not ask the workers' handle_preemptions (before the forward)"
        m = msgspec.msgpack.decode(meta.data)["m"]
        assert m.get("push_preempted") == ["p-2"], m
        assert conn.has_pending_block_frees() is False
        # Resumed and recomputed, it is not announced again: it finishes as
        # a push send through request_finished with its new blocks.
        conn.update_state_after_alloc(req, KVCacheBlocks(([h.KVCacheBlock(block_id=i, ref_cnt=1) for i in (12, 13)],)), 0)
        m = _meta(conn, _prompt_step(req, [12, 13], n))
        assert not m.get("push_early"), m
        req.num_computed_tokens = n
        req.append_output_token_ids(7)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, _ = conn.request_finished_all_groups(req, ([12, 13],))
        assert delay
        m = _meta(conn, SchedulerOutput.make_empty())
        assert "p-2" in (m.get("push_finished") or {}), m
    finally:
        conn.shutdown()


def test_push_aborted_after_announcement_keeps_its_blocks(gv):
    """An abort after the prompt's forward leaves whole KV that the early
    WRITE may be reading: the blocks stay held (a push send), whatever the
    status."""
    mod, _ = gv
    conn = _sched(mod, mod.GoNixlPushConnector, "kv_producer", "own-push-p3", {})
    try:
        n = BS + 1
        req = h.Engine.request("p-3", n, {"do_remote_decode": True})
        conn.update_state_after_alloc(req, KVCacheBlocks(([h.KVCacheBlock(block_id=i, ref_cnt=1) for i in (3, 4)],)), 0)
        _meta(conn, _prompt_step(req, [3, 4], n))
        req.status = RequestStatus.FINISHED_ABORTED
        delay, _ = conn.request_finished_all_groups(req, ([3, 4],))
        assert delay, "an aborted announced request's blocks were given back while its WRITE may read them"
        # Not announced: an abort frees at once.
        req2 = h.Engine.request("p-4", n, {"do_remote_decode": True})
        conn.update_state_after_alloc(req2, KVCacheBlocks(([h.KVCacheBlock(block_id=i, ref_cnt=1) for i in (5, 6)],)), 0)
        req2.status = RequestStatus.FINISHED_ABORTED
        delay, _ = conn.request_finished_all_groups(req2, ([5, 6],))
        assert not delay
    finally:
        conn.shutdown()


def test_push_decode_keeps_vllm_stepping_while_it_holds_a_finished_request(gv, monkeypatch):
    """vLLM steps an engine without requests no more; a push decode whose
    worker holds an aborted request's blocks until the prefill answers
    asks for steps (has_pending_push_work) until finished_recving, for a
    bounded time."""
    mod, _ = gv
    conn = _sched(mod, mod.GoNixlPushConnector, "kv_consumer", "own-push-d", {})
    try:
        n = 2 * BS
        def params(client_id: str) -> dict:
            return {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": client_id, "remote_host": "127.0.0.1",
                    "remote_port": 5999, "tp_size": 1}

        req = h.Engine.request("d-1", n, params("c-1"))
        ext, is_async = conn.get_num_new_matched_tokens(req, 0)
        assert (ext, is_async) == (n, True)
        conn.update_state_after_alloc(req, KVCacheBlocks(([h.KVCacheBlock(block_id=i, ref_cnt=1) for i in (2, 3)],)), ext)
        assert conn.has_pending_push_work()  # the registration, for the worker
        _meta(conn, SchedulerOutput.make_empty())
        assert not conn.has_pending_push_work()  # waiting: vLLM steps for the request itself
        req.status = RequestStatus.FINISHED_ABORTED
        conn.request_finished_all_groups(req, ([2, 3],))
        assert conn.has_pending_push_work(), "an aborted request's held blocks do not keep vLLM stepping"
        from vllm.v1.outputs import KVConnectorOutput

        conn.update_connector_output(KVConnectorOutput(finished_recving={"d-1"}))
        assert not conn.has_pending_push_work()
        # Bounded: a hold that outlives the window stops asking.
        req2 = h.Engine.request("d-2", n, params("c-2"))
        conn.get_num_new_matched_tokens(req2, 0)
        conn.update_state_after_alloc(req2, KVCacheBlocks(([h.KVCacheBlock(block_id=i, ref_cnt=1) for i in (4, 5)],)), n)
        _meta(conn, SchedulerOutput.make_empty())
        req2.status = RequestStatus.FINISHED_ABORTED
        conn.request_finished_all_groups(req2, ([4, 5],))
        assert conn.has_pending_push_work()
        monkeypatch.setattr(mod, "_PUSH_HOLD_STEPPING", -1.0)
        assert not conn.has_pending_push_work()
    finally:
        conn.shutdown()


def test_push_prefill_past_its_prompt_writes_the_prompts_blocks(gv):
    """A push prefill whose request ran past its prompt (max_tokens > 1)
    hands over only the blocks of the prompt, with the prompt's digest:
    the decode registered blocks for the prompt and nothing else."""
    mod, _ = gv
    conn = _sched(mod, mod.GoNixlPushConnector, "kv_producer", "own-push-p5", {})
    try:
        n = 2 * BS + 3  # three blocks of prompt
        req = h.Engine.request("p-5", n, {"do_remote_decode": True}, max_tokens=8)
        for i in range(6):
            req.append_output_token_ids(11 + i)
        req.num_computed_tokens = n + 5  # past the prompt: a fourth block
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, _ = conn.request_finished_all_groups(req, ([4, 5, 6, 7],))
        assert delay
        m = _meta(conn, SchedulerOutput.make_empty())
        pf = (m.get("push_finished") or {}).get("p-5")
        assert pf is not None, m
        blocks = [b for g in pf["blocks"] for b in __import__("struct").unpack(f"<{len(g) // 8}q", g)]
        assert blocks == [4, 5, 6], blocks
        assert pf.get("prompt_digest") == mod.prompt_digest(req.prompt_token_ids, n)
    finally:
        conn.shutdown()
