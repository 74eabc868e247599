"""GoNixlConnector driven through vLLM's scheduler and worker call sequence.

Two vLLM instances live in this process -- a prefill (kv_producer) and a
decode (kv_consumer) -- each with a SCHEDULER-role and a WORKER-role
GoNixlConnector, vLLM's real VllmConfig / KVCacheConfig / Request /
KVCacheBlocks / SchedulerOutput / KVConnectorOutput objects, real CPU
KV-cache tensors allocated by vLLM's own allocate_kv_cache, the real
side channel (ZeroMQ on 127.0.0.1, distinct free ports) and the real UCX
transfer engine (kv_connector_extra_config transfer_engine=ucx). The
harness is tests/python/connector_harness.py.

Every wait is a bounded poll loop (a step of every engine every 10 ms, at
most 20 s). Each test checks the bytes the decode's KV cache holds
afterwards, not only what the connector reports.

Run: GONIXL_LIB_PATH=build/libgonixl.so .venv/bin/python -m pytest -q tests/python/test_connector.py
"""

from __future__ import annotations

import ast
import base64
import copy
import importlib.util
import inspect
import json
import os
import struct
import textwrap
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# vLLM and gonixl's engines are installed wherever these tests run (.venv,
# ./build.sh setup): missing, they fail the module, they do not skip it.
if importlib.util.find_spec("vllm") is None:  # pragma: no cover - environment
    raise ImportError("vLLM is not installed in this interpreter (use .venv/bin/python)")

import connector_harness as h  # noqa: E402  (imports vLLM)
import torch  # noqa: E402

import gonixl.vllm  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

P_BLOCKS = 40  # the prefill's KV cache, in blocks
D_BLOCKS = 56  # the decode's (different, so block ids do not line up by accident)


def _connector_class(lib_path: str):
    # The library under test is the one conftest's lib_path names.
    os.environ["GONIXL_LIB_PATH"] = lib_path
    import gonixl

    if importlib.util.find_spec("gonixl.vllm") is None:
        # An installed copy of the package older than the connector: use the
        # source tree's (same _lib and errors modules).
        gonixl.__path__.append(os.path.join(ROOT, "pybridge", "gonixl"))
    from gonixl.vllm import GoNixlConnector

    return GoNixlConnector


def _engine_unavailable(name: str) -> str:
    """Why gonixl's transfer engine `name` does not load here ("" if it does)."""
    import gonixl

    for e in gonixl.probe()["engines"]:
        if e["name"] == name:
            return "" if e["available"] else (e.get("reason") or "not available")
    return "not built into the library"


@pytest.fixture(scope="module")
def connector_cls(lib_path):
    cls = _connector_class(lib_path)
    why = _engine_unavailable("ucx")
    if why:
        pytest.fail(f"gonixl's UCX transfer engine does not load on this host: {why}")
    return cls


@pytest.fixture(scope="module")
def dist_env():
    """vLLM's worker-side parallel state, as one single-rank gloo group:
    GoNixlConnector's worker reads get_tp_group()/get_pp_group()."""
    from vllm.distributed import parallel_state as ps

    created = False
    if not ps.model_parallel_is_initialized():
        vc = h.make_vllm_config("kv_both", "dist-init", {})
        with h.set_current_vllm_config(vc):
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{h.free_port()}",
                local_rank=0,
                backend="gloo",
            )
            ps.ensure_model_parallel_initialized(1, 1)
        created = True
    assert ps.get_tp_group().rank_in_group == 0 and ps.get_pp_group().rank_in_group == 0
    yield
    if created:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


@pytest.fixture(scope="module")
def pd(connector_cls, dist_env):
    """A prefill and a decode instance with vLLM CPU's KV-cache layout."""
    engines = []
    try:
        p = h.Engine(connector_cls, "kv_producer", "engine-prefill", P_BLOCKS)
        engines.append(p)
        d = h.Engine(connector_cls, "kv_consumer", "engine-decode", D_BLOCKS)
        engines.append(d)
        p.fill_all(-7.0)
        d.fill_all(-3.0)
        yield p, d
    finally:
        for e in engines:
            e.shutdown()


# ----------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------


def vllm_request_finished_keys() -> set[str]:
    """The keys of the dict the installed vLLM's NixlPullConnectorScheduler.
    request_finished returns for a finished request (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(NixlPullConnectorScheduler.request_finished)))
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            for elt in node.value.elts:
                if isinstance(elt, ast.Call) and getattr(elt.func, "id", None) == "dict":
                    keys |= {kw.arg for kw in elt.keywords}
                elif isinstance(elt, ast.Dict):
                    keys |= {k.value for k in elt.keys if isinstance(k, ast.Constant)}
    assert keys, "could not find the kv_transfer_params dict in vLLM's request_finished"
    return keys


def assert_blocks_copied(p: h.Engine, d: h.Engine, src: list[int], dst: list[int], before: dict) -> None:
    """d's blocks dst hold exactly p's blocks src (every layer, K and V);
    every other block of d is unchanged since `before`."""
    assert len(src) == len(dst)
    names = h.layer_names(d.vllm_config)
    for name in names:
        for s, t in zip(src, dst):
            got, want = d.block(name, t), p.block(name, s)
            assert torch.equal(got, want), f"{name}: decode block {t} != prefill block {s}"
        cur, old = d.kv_caches[name], before[name]
        others = [b for b in range(d.num_blocks) if b not in set(dst)]
        idx = torch.tensor(others, dtype=torch.long)
        dim = 1 if d.kv_shape == "flash_attn" else 0
        assert torch.equal(cur.index_select(dim, idx), old.index_select(dim, idx)), f"{name}: a block outside {dst} changed"


def assert_kv_unchanged(d: h.Engine, before: dict) -> None:
    for name, t in d.kv_caches.items():
        assert torch.equal(t, before[name]), f"{name}: the decode's KV cache changed"


def count(xs: list[str], x: str) -> int:
    return sum(1 for y in xs if y == x)


def transfer(p: h.Engine, d: h.Engine, tag: str, num_tokens: int, local_hit_blocks: int = 0):
    """Prefill -> decode for one request; returns (prefilled, decode req,
    D KV snapshot before the load)."""
    pre = h.prefill(p, f"{tag}-p", num_tokens, seed=hash(tag) % 97)
    assert pre.delay is True
    before = d.snapshot()
    dr = h.schedule_decode(d, f"{tag}-d", num_tokens, pre.params, local_hit_blocks)
    return pre, dr, before


def wait_transfer_done(p: h.Engine, d: h.Engine, pre: h.Prefilled, dr: h.DecodeReq) -> None:
    pid, did = pre.req.request_id, dr.req.request_id
    h.run_until(
        [p, d],
        lambda: did in d.out.recving and pid in p.out.sending,
        f"decode finished_recving {did} and prefill finished_sending {pid}",
    )


def finish_decode(d: h.Engine, dr: h.DecodeReq) -> None:
    """The decode request runs its decode steps and stops: a decode node
    frees its blocks at once and returns no kv_transfer_params."""
    dr.req.status = RequestStatus.FINISHED_STOPPED
    blocks = dr.local_hit + dr.new_blocks
    delay, params = d.sched.request_finished(dr.req, blocks)
    assert (delay, params) == (False, None)
    d.free(blocks)
    d.finished_req_ids.add(dr.req.request_id)


# ----------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------


def test_kv_cache_layout_is_the_connectors(pd, connector_cls):
    """vLLM resolves the layout from the CPU backend's supported set and the
    connector's preference (loaded through kv_connector_module_path)."""
    p, d = pd
    assert connector_cls.get_required_kvcache_layout(p.vllm_config) == "LBHNC"
    for e in pd:
        assert e.vllm_config.cache_config.kv_cache_layout == "LBHNC"
        spec = h.attention_spec(e.vllm_config)
        for t in e.kv_caches.values():
            # [num_blocks, num_kv_heads, block_size, 2 * head_size], one block
            # one contiguous page; all layers in one allocation.
            assert tuple(t.shape) == (e.num_blocks, spec.num_kv_heads, h.BLOCK_SIZE, 2 * spec.head_size)
            assert t.is_contiguous() and t.device.type == "cpu"
        assert len({t.untyped_storage().data_ptr() for t in e.kv_caches.values()}) == 1


def test_request_finished_returns_vllms_kv_transfer_params(pd):
    p, d = pd
    pre, dr, _ = transfer(p, d, "keys", 70)
    params = pre.params
    # vLLM's keys, plus gonixl's digest of the prompt the blocks hold, the
    # id of the process that holds them and the digests of their KV
    # (docs/PROTOCOL.md).
    assert set(params) == vllm_request_finished_keys() | {"gonixl_prompt_digest", "gonixl_instance", "gonixl_kv_digest"}, sorted(params)
    assert params["gonixl_prompt_digest"] == gonixl.vllm.prompt_digest(pre.req.prompt_token_ids, 70)
    kd = params["gonixl_kv_digest"]
    assert kd["alg"] == "xxh3-64" and kd["tokens"] == 70 and kd["first"] == [0] and len(kd["ranks"]) == 1, kd
    digests = struct.unpack("<3Q", base64.b64decode(kd["ranks"][0]["blocks"][0]))
    assert all(digests) and len(set(digests)) == 3, digests
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [pre.block_ids]  # one list per KV-cache group
    assert len(pre.block_ids) == 3
    assert params["remote_engine_id"] == "engine-prefill"
    assert params["remote_request_id"] == "keys-p"
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == p.port
    assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
    assert params["remote_num_tokens"] == 70
    # vLLM stamps only a decode's blocks; gonixl also sends the prefill's
    # lease expiry (its scheduler clock) so a gonixl decode can refuse KV
    # whose lease lapsed. A stock decode ignores it outside bidirectional mode.
    assert isinstance(params["remote_blocks_expiry_time"], float) and params["remote_blocks_expiry_time"] > 0
    assert params["transfer_mode"] == "pull"
    json.dumps(params)  # travels in the HTTP response
    # The decode side took the params over (by the end of the step that
    # scheduled it: update_state_after_alloc's answer comes with the step's
    # build_connector_meta, as vLLM calls them): one transfer per request.
    d.step()
    assert dr.req.kv_transfer_params["do_remote_prefill"] is False
    assert dr.req.kv_transfer_params["_remote_blocks_processed"] is True
    wait_transfer_done(p, d, pre, dr)
    finish_decode(d, dr)


def test_request_finished_without_blocks_or_params(pd):
    p, _ = pd
    # No kv_transfer_params: not a disaggregated request.
    req = p.request("plain", 10, None)
    req.status = RequestStatus.FINISHED_STOPPED
    assert p.sched.request_finished(req, [1]) == (False, None)
    # Aborted on the prefill: freed now, the workers stop tracking it.
    req = p.request("aborted-p", 10, dict(h.PROXY_PREFILL_PARAMS))
    req.status = RequestStatus.FINISHED_ABORTED
    assert p.sched.request_finished(req, [1]) == (False, None)
    # Finished normally but no blocks: nothing to hold, params still returned.
    req = p.request("noblocks-p", 10, dict(h.PROXY_PREFILL_PARAMS))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.sched.request_finished(req, [])
    assert delay is False
    assert params is not None and set(params) == vllm_request_finished_keys() | {"gonixl_instance"}
    assert params["remote_num_tokens"] == 0 and params["do_remote_prefill"] is True


def test_params_of_another_prompt_are_never_used(pd):
    """A decode request carrying the kv_transfer_params of another prompt of
    the same length (a proxy mix-up, or a client replaying someone else's
    parameters) is computed locally: no READ of the other request's blocks,
    and no notification that would free them under their owner."""
    p, d = pd
    pre = h.prefill(p, "owner-p", 70, seed=5.0)
    req = d.request("intruder-d", 70, copy.deepcopy(pre.params), max_tokens=4)
    req.prompt_token_ids[40] = (req.prompt_token_ids[40] + 1) % 60  # one token differs
    h.run_steps([p, d], 3)  # what earlier tests left is reported first
    stats_before = len(d.out.stats)
    d.add_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not req.kv_transfer_params.get("do_remote_prefill")
    assert not any(k.startswith("remote_") for k in req.kv_transfer_params)
    d.sched.update_state_after_alloc(req, KVCacheBlocks((d.alloc(3),)), 0)
    h.run_steps([p, d], 5)
    assert "owner-p" in p.held, "the owner's blocks were freed by the intruder's request"
    assert "owner-p" not in p.out.sending
    assert not any(s.data.get("transfer_duration") for s in d.out.stats[stats_before:])
    # The owner's own decode still reads them.
    before = d.snapshot()
    dr = h.schedule_decode(d, "owner-d", 70, pre.params)
    wait_transfer_done(p, d, pre, dr)
    assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
    finish_decode(d, dr)


def test_request_finished_without_blocks_keeps_the_group_shape(pd):
    p, _ = pd
    req = p.request("noblocks2-p", 10, dict(h.PROXY_PREFILL_PARAMS))
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.sched.request_finished(req, [])
    assert params["remote_block_ids"] == [[]]


@pytest.mark.parametrize(
    "num_tokens",
    [
        pytest.param(1, id="one_token"),
        pytest.param(5, id="shorter_than_a_block"),
        pytest.param(70, id="partial_last_block"),
        pytest.param(96, id="exact_multiple_of_blocks"),
        pytest.param(32 * 9 + 1, id="many_blocks_plus_one"),
    ],
)
def test_prefill_to_decode_copies_the_blocks(pd, num_tokens):
    p, d = pd
    tag = f"xfer{num_tokens}"
    recv_before, send_before = len(d.out.recving), len(p.out.sending)
    pre, dr, before = transfer(p, d, tag, num_tokens)
    n_blocks = h.cdiv(num_tokens, h.BLOCK_SIZE)
    assert len(pre.block_ids) == n_blocks
    # The whole prompt, partial last block included, loads asynchronously.
    assert (dr.n_ext, dr.load_async) == (num_tokens, True)
    assert len(dr.new_blocks) == n_blocks
    wait_transfer_done(p, d, pre, dr)
    assert dr.req.request_id not in d.out.failed
    assert not d.out.invalid_blocks
    assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
    # The prefill freed its blocks on the decode's notification.
    assert pre.req.request_id not in p.held
    # Reported exactly once, by the right side.
    h.run_steps([p, d], 3)
    assert count(d.out.recving[recv_before:], dr.req.request_id) == 1
    assert count(p.out.sending[send_before:], pre.req.request_id) == 1
    assert pre.req.request_id not in d.out.recving and dr.req.request_id not in p.out.sending
    finish_decode(d, dr)


def test_get_finished_call_site(pd):
    """vLLM's older call site, get_finished(), gives the same sets."""
    p, d = pd
    d.use_get_finished = True
    try:
        pre, dr, before = transfer(p, d, "getfinished", 40)
        wait_transfer_done(p, d, pre, dr)
        assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
    finally:
        d.use_get_finished = False
    finish_decode(d, dr)


def test_partial_local_prefix_hit_reads_only_the_tail(pd):
    """The decode has the first block of the prompt in its prefix cache: it
    loads the remaining tokens into its new blocks, from the prefill's last
    blocks (vLLM trims the remote list from the front)."""
    p, d = pd
    pre, dr, before = transfer(p, d, "prefix1", 100, local_hit_blocks=1)
    assert (dr.n_ext, dr.load_async) == (100 - h.BLOCK_SIZE, True)
    assert len(dr.local_hit) == 1 and len(dr.new_blocks) == 3
    wait_transfer_done(p, d, pre, dr)
    assert dr.req.request_id not in d.out.failed
    assert_blocks_copied(p, d, pre.block_ids[1:], dr.new_blocks, before)
    finish_decode(d, dr)


def test_full_local_prefix_hit_sends_notification_only(pd):
    p, d = pd
    recv_before = len(d.out.recving)
    stats_before = len(d.out.stats)
    pre, dr, before = transfer(p, d, "fullhit", 64, local_hit_blocks=2)
    # Every prompt token is cached locally: nothing to load ...
    assert (dr.n_ext, dr.load_async) == (0, False)
    assert dr.new_blocks == []
    # ... but the prefill must still hear that it can free its blocks (the
    # step's build_connector_meta carries update_state_after_alloc).
    d.step()
    assert dr.req.kv_transfer_params["do_remote_prefill"] is False
    h.run_until([p, d], lambda: pre.req.request_id in p.out.sending, "prefill finished_sending after notify-only")
    assert pre.req.request_id not in p.held
    h.run_steps([p, d], 3)
    # Not awaited by the decode's scheduler: never reported as received.
    assert dr.req.request_id not in d.out.recving[recv_before:]
    assert not any(s.num_successful_transfers for s in d.out.stats[stats_before:])
    assert_kv_unchanged(d, before)
    finish_decode(d, dr)


def test_abort_before_scheduling_sends_notification_only(pd):
    p, d = pd
    recv_before = len(d.out.recving)
    pre = h.prefill(p, "abort-p", 50, seed=5)
    before = d.snapshot()
    req = d.request("abort-d", 50, dict(pre.params))
    d.add_request(req)
    h.run_steps([p, d], 2)  # queued, never scheduled (heartbeats may go out)
    req.status = RequestStatus.FINISHED_ABORTED
    assert d.sched.request_finished(req, []) == (False, None)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    d.finished_req_ids.add("abort-d")
    h.run_until([p, d], lambda: "abort-p" in p.out.sending, "prefill finished_sending after the decode's abort")
    assert "abort-p" not in p.held
    h.run_steps([p, d], 3)
    assert "abort-d" not in d.out.recving[recv_before:]
    assert_kv_unchanged(d, before)


def test_several_requests_in_one_step_and_across_steps(pd):
    """Two requests scheduled in the same step, a third one step later, a
    fourth while the others may still be in flight. (GoNixlConnector, like
    vLLM's NixlConnector, issues one READ per request and source rank.)"""
    p, d = pd
    pres = [h.prefill(p, f"multi{i}-p", n, seed=10 + i) for i, n in enumerate((33, 64, 7, 130))]
    before = d.snapshot()
    drs = [h.schedule_decode(d, f"multi{i}-d", n, pres[i].params) for i, n in enumerate((33, 64))]
    d.step()
    drs.append(h.schedule_decode(d, "multi2-d", 7, pres[2].params))
    p.step()
    d.step()
    drs.append(h.schedule_decode(d, "multi3-d", 130, pres[3].params))
    h.run_until(
        [p, d],
        lambda: all(r.req.request_id in d.out.recving for r in drs) and all(x.req.request_id in p.out.sending for x in pres),
        "four transfers",
    )
    assert not any(r.req.request_id in d.out.failed for r in drs)
    src = [b for x in pres for b in x.block_ids]
    dst = [b for r in drs for b in r.new_blocks]
    assert_blocks_copied(p, d, src, dst, before)
    for r in drs:
        finish_decode(d, r)


def test_stats_reported_once_then_reset(pd, connector_cls):
    p, d = pd
    d.step()
    stats_before = len(d.out.stats)
    pre, dr, _ = transfer(p, d, "stats", 80)
    wait_transfer_done(p, d, pre, dr)
    got = d.out.stats[stats_before:]
    assert got, "get_kv_connector_stats returned None in every step of a transfer"
    assert all(isinstance(s, NixlKVConnectorStats) for s in got)
    agg = connector_cls.build_kv_connector_stats()
    for s in got:
        agg = agg.aggregate(s)
    n_blocks = h.cdiv(80, h.BLOCK_SIZE)
    spec = h.attention_spec(d.vllm_config)
    n_layers = len(h.layer_names(d.vllm_config))
    assert agg.num_successful_transfers == 1
    assert agg.data["bytes_transferred"] == [n_blocks * n_layers * spec.page_size_bytes]
    # NIXL counts descriptors after merging adjacent ones: at most one per
    # (layer, block).
    assert len(agg.data["num_descriptors"]) == 1 and 1 <= agg.data["num_descriptors"][0] <= n_blocks * n_layers
    assert agg.data["num_failed_transfers"] == []
    assert all(x >= 0 for x in agg.data["transfer_duration"] + agg.data["post_duration"])
    # Retrieval resets: the very next call has nothing.
    assert d.worker.get_kv_connector_stats() is None
    # The frontend rebuilds the stats from their serialised data dict.
    data = json.loads(json.dumps(agg.data))
    rebuilt = connector_cls.build_kv_connector_stats(data=data)
    assert isinstance(rebuilt, NixlKVConnectorStats)
    assert set(data) == set(NixlKVConnectorStats().data)
    red = rebuilt.reduce()
    assert list(red) == list(NixlKVConnectorStats().reduce())
    assert red["Num successful transfers"] == 1
    assert red["Avg MB per transfer"] == round(n_blocks * n_layers * spec.page_size_bytes / 2**20, 3)
    assert red["Avg number of descriptors"] == float(agg.data["num_descriptors"][0])
    # vLLM's CLI logger loads the connector class from kv_connector_module_path
    # and prints the line.
    lines: list[str] = []
    logging_ = KVConnectorLogging(d.vllm_config.kv_transfer_config)
    logging_.observe(data)
    logging_.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: Num successful transfers=1, Avg xfer time (ms)=")
    # The prefill recorded nothing for serving the read.
    assert p.worker.get_kv_connector_stats() is None
    finish_decode(d, dr)


def test_load_error_remote_block_out_of_range(pd):
    """A kv_transfer_params naming a block the prefill does not have: the
    request fails, its local blocks are reported as load errors no later than
    the step that reports it finished, and nothing is read."""
    p, d = pd
    pre = h.prefill(p, "oor-p", 64, seed=3)
    bad = dict(pre.params)
    bad["remote_block_ids"] = [[pre.block_ids[0], P_BLOCKS + 1000]]
    before = d.snapshot()
    dr = h.schedule_decode(d, "oor-d", 64, bad)
    assert dr.load_async
    inv_before = len(d.out.invalid_blocks)
    h.run_until([p, d], lambda: "oor-d" in d.out.recving, "the failed request in finished_recving")
    assert "oor-d" in d.out.failed
    invalid = set().union(*d.out.invalid_blocks[inv_before:])
    assert invalid == set(dr.new_blocks)
    # No later than the step that reports the request finished (vLLM's rule).
    assert set(dr.new_blocks) <= d.out.invalid_until_recv("oor-d")
    assert_kv_unchanged(d, before)
    assert d.worker.get_block_ids_with_load_errors() == set()  # drained
    finish_decode(d, dr)


def test_load_error_with_several_kv_cache_groups_is_per_request(pd, monkeypatch):
    """With more than one KV-cache group block ids are unique only within a
    group, and vLLM's scheduler raises RuntimeError on invalid_block_ids for
    such a layout (_handle_invalid_blocks): a failed load is then reported
    in failed_recving only, never as block ids."""
    p, d = pd
    pre = h.prefill(p, "grp-p", 64, seed=5)
    bad = dict(pre.params)
    bad["remote_block_ids"] = [[pre.block_ids[0], P_BLOCKS + 1000]]
    # The worker connector sees a two-group layout (a copy: the scheduler
    # side and the harness keep the real one-group config).
    two = copy.copy(d.worker.kv_cache_config)
    object.__setattr__(two, "kv_cache_groups", [two.kv_cache_groups[0]] * 2)
    monkeypatch.setattr(d.worker, "kv_cache_config", two)
    inv_before = len(d.out.invalid_blocks)
    dr = h.schedule_decode(d, "grp-d", 64, bad)
    h.run_until([p, d], lambda: "grp-d" in d.out.recving, "the failed request in finished_recving")
    assert "grp-d" in d.out.failed
    assert d.out.invalid_blocks[inv_before:] == [], "invalid_block_ids reported for a multi-group layout"
    monkeypatch.undo()
    assert d.worker.get_block_ids_with_load_errors() == set()  # drained while the layout had two groups
    finish_decode(d, dr)


@pytest.mark.parametrize("bad_ids", [[-1, 2], [0, 2**40], [[1]]], ids=["negative", "huge", "nested"])
def test_bad_remote_block_ids_never_read(pd, bad_ids):
    """Malformed remote block ids: the request is either computed locally
    (no external tokens) or fails its load; the decode's KV is untouched and
    the engine keeps serving."""
    p, d = pd
    pre = h.prefill(p, f"badids{len(d.out.recving)}-p", 64, seed=6)
    bad = dict(pre.params)
    bad["remote_block_ids"] = [bad_ids]
    before = d.snapshot()
    dr = h.schedule_decode(d, pre.req.request_id[:-2] + "-d", 64, bad)
    if dr.load_async:
        h.run_until([p, d], lambda: dr.req.request_id in d.out.recving, "the failed request in finished_recving")
        assert dr.req.request_id in d.out.failed
    else:
        assert dr.n_ext == 0
    assert_kv_unchanged(d, before)
    finish_decode(d, dr)


def test_load_error_remote_engine_id_mismatch(pd):
    """The side channel answers for another engine id: the handshake is
    refused (no retry), the request fails with its blocks as load errors."""
    p, d = pd
    pre = h.prefill(p, "wrongeng-p", 40, seed=8)
    bad = dict(pre.params)
    bad["remote_engine_id"] = "engine-impostor"
    before = d.snapshot()
    stats_before, inv_before = len(d.out.stats), len(d.out.invalid_blocks)
    dr = h.schedule_decode(d, "wrongeng-d", 40, bad)
    h.run_until([p, d], lambda: "wrongeng-d" in d.out.recving, "the failed request in finished_recving")
    assert "wrongeng-d" in d.out.failed
    assert set().union(*d.out.invalid_blocks[inv_before:]) == set(dr.new_blocks)
    assert set(dr.new_blocks) <= d.out.invalid_until_recv("wrongeng-d")
    assert_kv_unchanged(d, before)
    agg = NixlKVConnectorStats()
    for st in d.out.stats[stats_before:]:
        agg = agg.aggregate(st)
    assert len(agg.data["num_failed_handshakes"]) == 1 and agg.num_successful_transfers == 0
    finish_decode(d, dr)


def test_setup_failure_is_counted_in_stats(pd):
    p, d = pd
    d.step()
    stats_before = len(d.out.stats)
    pre = h.prefill(p, "oorstat-p", 40, seed=4)
    bad = dict(pre.params)
    bad["remote_block_ids"] = [[P_BLOCKS + 5, P_BLOCKS + 6]]
    dr = h.schedule_decode(d, "oorstat-d", 40, bad)
    h.run_until([p, d], lambda: "oorstat-d" in d.out.recving, "the failed request in finished_recving")
    failed = sum(len(s.data["num_failed_transfers"]) for s in d.out.stats[stats_before:])
    finish_decode(d, dr)
    assert failed == 1


def test_load_error_side_channel_unreachable(connector_cls, dist_env):
    """The prefill's side channel does not answer: with handshake_timeout 1
    the request fails within the poll bound, its blocks are load errors,
    and a failed handshake is counted."""
    d = h.Engine(connector_cls, "kv_consumer", "engine-decode-hs", 24, extra={"transfer_engine": "ucx", "handshake_timeout": 1})
    try:
        d.fill_all(1.5)
        before = d.snapshot()
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[3, 4]],
            "remote_engine_id": "engine-nowhere",
            "remote_request_id": "ghost-p",
            "remote_host": "127.0.0.1",
            "remote_port": h.free_port(),  # nothing listens there
            "tp_size": 1,
        }
        dr = h.schedule_decode(d, "ghost-d", 50, params)
        assert dr.load_async and len(dr.new_blocks) == 2
        h.run_until([d], lambda: "ghost-d" in d.out.recving, "the request whose handshake failed", timeout=20)
        assert "ghost-d" in d.out.failed
        assert set().union(*d.out.invalid_blocks) == set(dr.new_blocks)
        assert set(dr.new_blocks) <= d.out.invalid_until_recv("ghost-d")
        assert_kv_unchanged(d, before)
        agg = NixlKVConnectorStats()
        for s in d.out.stats:
            agg = agg.aggregate(s)
        assert agg.num_successful_transfers == 0
        assert len(agg.data["num_failed_handshakes"]) >= 1
        assert agg.reduce()["Num failed transfers"] >= 1
        finish_decode(d, dr)
    finally:
        d.shutdown()


def test_bad_kv_transfer_params_fail_only_that_request(pd):
    p, d = pd
    bad = {"do_remote_prefill": True, "remote_block_ids": "not-a-list", "remote_engine_id": 7, "remote_port": "x"}
    req = d.request("badparams-d", 40, bad)
    d.add_request(req)  # logs, never raises
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    # The engine keeps serving: a good transfer right after.
    pre, dr, before = transfer(p, d, "afterbad", 40)
    wait_transfer_done(p, d, pre, dr)
    assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
    finish_decode(d, dr)


@pytest.mark.parametrize(
    "broken",
    [
        "no_remote_block_ids",
        "empty_remote_block_ids",
        "no_remote_host",
    ],
)
def test_decode_request_with_unusable_params_is_not_left_waiting(pd, broken):
    """do_remote_prefill with kv_transfer_params that cannot be used (a
    broken proxy): the request must either be computed locally (no external
    tokens) or be reported as a failed load -- never wait for KV that no one
    will send. No network is involved, so either outcome is immediate."""
    p, d = pd
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "engine-prefill",
        "remote_request_id": f"{broken}-p",
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": 1,
    }
    if broken == "no_remote_block_ids":
        del params["remote_block_ids"]
    elif broken == "empty_remote_block_ids":
        params["remote_block_ids"] = [[]]
    elif broken == "no_remote_host":
        del params["remote_host"]
    dr = h.schedule_decode(d, f"{broken}-d", 40, params)
    try:
        if dr.load_async:
            h.run_until([p, d], lambda: dr.req.request_id in d.out.recving, "the request in finished_recving", timeout=3)
            assert dr.req.request_id in d.out.failed
        else:
            assert dr.n_ext == 0
    finally:
        finish_decode(d, dr)


def test_flash_attention_layout(connector_cls, dist_env):
    """FlashAttention-shaped caches, [2, num_blocks, block_size, heads,
    head_dim] per layer (K and V planes outside the block dimension): both
    planes of every block arrive."""
    engines = []
    try:
        p = h.Engine(connector_cls, "kv_producer", "engine-prefill-fa", 24, kv_shape="flash_attn")
        engines.append(p)
        d = h.Engine(connector_cls, "kv_consumer", "engine-decode-fa", 36, kv_shape="flash_attn")
        engines.append(d)
        p.fill_all(-1.0)
        d.fill_all(-2.0)
        for n in (20, 70):
            pre, dr, before = transfer(p, d, f"fa{n}", n)
            wait_transfer_done(p, d, pre, dr)
            assert dr.req.request_id not in d.out.failed
            assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
            # K and V planes both moved: 2 regions per layer.
            stats = NixlKVConnectorStats()
            for s in d.out.stats:
                stats = stats.aggregate(s)
            spec = h.attention_spec(d.vllm_config)
            assert stats.data["bytes_transferred"][-1] == len(pre.block_ids) * 2 * spec.page_size_bytes
            assert 1 <= stats.data["num_descriptors"][-1] <= len(pre.block_ids) * 2 * 2
            finish_decode(d, dr)
    finally:
        for e in engines:
            e.shutdown()


def test_shutdown_is_idempotent(connector_cls, dist_env):
    from gonixl import errors

    e = h.Engine(connector_cls, "kv_producer", "engine-shutdown", 8)
    e.shutdown()
    e.shutdown()
    # After shutdown the worker reports nothing, and the scheduler's handle
    # is gone: a clear error, never a crash.
    assert e.worker.get_kv_connector_stats() is None
    with pytest.raises(errors.InvalidHandleError):
        e.sched.build_connector_meta(h.SchedulerOutput.make_empty())


# ----------------------------------------------------------------------
# leases (the prefill holds finished requests' blocks for kv_lease_duration)
# ----------------------------------------------------------------------


def _sum_stats(stats) -> NixlKVConnectorStats:
    agg = NixlKVConnectorStats()
    for s in stats:
        agg = agg.aggregate(s)
    return agg


@pytest.fixture
def lease_engines(connector_cls, dist_env):
    made: list[h.Engine] = []

    def make(role: str, name: str, lease: float, blocks: int = 16) -> h.Engine:
        e = h.Engine(connector_cls, role, name, blocks, extra={"transfer_engine": "ucx", "kv_lease_duration": lease})
        made.append(e)
        return e

    yield make
    for e in made:
        e.shutdown()


def test_unread_lease_expires_and_a_late_read_is_refused(pd, lease_engines):
    """Nobody reads: the prefill frees the blocks when the lease ends and
    counts an expired request; a decode that comes later does not read them
    (it fails the load instead of copying blocks that may be reused)."""
    _, d = pd
    p = lease_engines("kv_producer", "engine-prefill-lease1", 1)
    pre = h.prefill(p, "lease1-p", 64, seed=21)
    assert pre.delay
    h.run_until([p], lambda: "lease1-p" in p.out.sending, "the prefill's lease to expire")
    assert "lease1-p" not in p.held
    assert len(_sum_stats(p.out.stats).data["num_kv_expired_reqs"]) == 1
    before = d.snapshot()
    stats_before = len(d.out.stats)
    dr = h.schedule_decode(d, "lease1-d", 64, pre.params)
    h.run_until([p, d], lambda: "lease1-d" in d.out.recving, "the decode to give up on the expired request")
    assert "lease1-d" in d.out.failed
    assert_kv_unchanged(d, before)
    assert _sum_stats(d.out.stats[stats_before:]).num_successful_transfers == 0
    finish_decode(d, dr)


def test_heartbeats_keep_a_waiting_requests_lease(lease_engines):
    """The decode's request waits in its queue longer than the prefill's
    lease: its heartbeats ("HB:<ids>", every kv_lease_duration // 6) keep the
    blocks held, and the decode's abort, not the lease, frees them."""
    p = lease_engines("kv_producer", "engine-prefill-hb", 3)
    d = lease_engines("kv_consumer", "engine-decode-hb", 3)
    pre = h.prefill(p, "hb-p", 40, seed=22)
    req = d.request("hb-d", 40, dict(pre.params))
    d.add_request(req)
    h.run_for([p, d], 4.5)  # 1.5x the lease, with heartbeats going out
    assert "hb-p" not in p.out.sending, "the lease expired although the decode kept sending heartbeats"
    req.status = RequestStatus.FINISHED_ABORTED
    assert d.sched.request_finished(req, []) == (False, None)
    h.run_until([p, d], lambda: "hb-p" in p.out.sending, "the prefill to free the blocks on the abort notification")
    assert _sum_stats(p.out.stats).data["num_kv_expired_reqs"] == []


def test_heartbeat_after_expiry_does_not_revive_the_lease(lease_engines):
    """The prefill's lease ends while the decode's request is still queued;
    the decode's heartbeats after that cannot revive it. Its later READ must
    fail, or return the request's own KV -- never blocks the prefill has
    since given to another request."""
    p = lease_engines("kv_producer", "engine-prefill-stale", 1)
    d = lease_engines("kv_consumer", "engine-decode-stale", 12)  # heartbeat every 2 s
    pre = h.prefill(p, "stale-p", 64, seed=23)
    original = {n: [p.block(n, b) for b in pre.block_ids] for n in h.layer_names(p.vllm_config)}
    h.run_until([p], lambda: "stale-p" in p.out.sending, "the prefill's lease to expire")
    # The freed blocks go to another request, which overwrites them.
    for b in pre.block_ids:
        p.fill_block(b, seed=99)
    req_d = d.request("stale-d", 64, dict(pre.params))
    d.add_request(req_d)  # queued: heartbeats start (the first one handshakes)
    h.run_for([p, d], 5.0)  # two more heartbeat rounds
    before = d.snapshot()
    dr = h.schedule_decode(d, "stale-d", 64, pre.params, queued=req_d)
    assert dr.load_async
    h.run_until([p, d], lambda: "stale-d" in d.out.recving, "the decode's load to end")
    if "stale-d" not in d.out.failed:
        for n, blocks in original.items():
            for want, b in zip(blocks, dr.new_blocks):
                assert torch.equal(d.block(n, b), want), f"{n}: block {b} holds another request's KV (read after the lease)"
    else:
        assert_kv_unchanged(d, before)


# ----------------------------------------------------------------------
# Prometheus
# ----------------------------------------------------------------------


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    # vLLM turns prometheus_client's *_created series off
    # (disable_created_metrics); they are not part of the comparison.
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def _sample_names(fam) -> set[str]:
    return {s.name for s in fam.samples if not s.name.endswith("_created")}


def _buckets(fam) -> list[float]:
    return sorted({float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"})


def test_prometheus_metrics_match_vllms(pd):
    """The stats of one transfer, fed to vLLM's Prometheus plumbing
    (KVConnectorProm -> GoNixlConnector.build_prom_metrics), land in vLLM's
    NIXL metrics; gonixl's own registry has the same metric names, types,
    sample names and buckets."""
    import functools

    import prometheus_client as pc
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    p, d = pd
    d.step()
    stats_before = len(d.out.stats)
    pre, dr, _ = transfer(p, d, "prom", 100)
    wait_transfer_done(p, d, pre, dr)
    agg = _sum_stats(d.out.stats[stats_before:])
    assert agg.num_successful_transfers == 1

    registry = pc.CollectorRegistry()

    class Prom(KVConnectorProm):  # vLLM's, with a private registry
        _gauge_cls = functools.partial(pc.Gauge, registry=registry)
        _counter_cls = functools.partial(pc.Counter, registry=registry)
        _histogram_cls = functools.partial(pc.Histogram, registry=registry)

    prom = Prom(d.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom.prom_metrics is not None
    prom.observe(json.loads(json.dumps(agg.data)), 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:nixl_xfer_time_seconds_count", labels) == 1
    assert registry.get_sample_value("vllm:nixl_bytes_transferred_sum", labels) == agg.data["bytes_transferred"][0]
    assert registry.get_sample_value("vllm:nixl_num_failed_transfers_total", labels) == 0

    want = _families(pc.generate_latest(registry).decode())
    got = _families(d.worker.metrics_text())
    nixl = {n: f for n, f in got.items() if n.startswith("vllm:nixl_")}
    assert set(nixl) == set(want)
    for name, fam in want.items():
        assert nixl[name].type == fam.type, name
        assert _sample_names(nixl[name]) == _sample_names(fam), name
        if fam.type == "histogram":
            assert _buckets(nixl[name]) == _buckets(fam), name
    # gonixl's registry counted the same transfer (its counters are cumulative).
    xfer_count = [s.value for s in nixl["vllm:nixl_xfer_time_seconds"].samples if s.name.endswith("_count")]
    assert sum(xfer_count) >= 1
    finish_decode(d, dr)


def test_kv_both_still_works_with_a_deprecation_warning(connector_cls, dist_env, capfd):
    e = h.Engine(connector_cls, "kv_both", "engine-both", 8)
    try:
        # gonixl logs through zap to stderr.
        err = capfd.readouterr().err
        assert "kv_both" in err and "deprecated" in err, err[-2000:]
        # A working engine: one step through both roles.
        out = e.step()
        assert out.is_empty()
        # The scheduler-side instance (newer vLLM asks it too) has no stats.
        assert e.sched.get_kv_connector_stats() is None
        assert e.sched.get_finished_count() is None
    finally:
        e.shutdown()


@pytest.mark.parametrize("engine", ["nixl", "auto"])
def test_other_transfer_engines(connector_cls, dist_env, engine):
    """The same P -> D flow on gonixl's NIXL engine (libnixl from the nixl
    wheel) and on "auto" (what a configuration without transfer_engine gets)."""
    if engine == "nixl" and (why := _engine_unavailable("nixl")):
        pytest.skip(f"gonixl's NIXL engine does not load on this host: {why}")
    extra = {"transfer_engine": engine}
    engines = []
    try:
        p = h.Engine(connector_cls, "kv_producer", f"engine-prefill-{engine}", 20, extra=extra)
        engines.append(p)
        d = h.Engine(connector_cls, "kv_consumer", f"engine-decode-{engine}", 28, extra=extra)
        engines.append(d)
        p.fill_all(-4.0)
        d.fill_all(-5.0)
        for n in (20, 100):
            pre, dr, before = transfer(p, d, f"{engine}{n}", n)
            wait_transfer_done(p, d, pre, dr)
            assert dr.req.request_id not in d.out.failed
            assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
            finish_decode(d, dr)
        agg = _sum_stats(d.out.stats)
        spec = h.attention_spec(d.vllm_config)
        n_layers = len(h.layer_names(d.vllm_config))
        # One transfer of 1 block, then one of 4 blocks, every layer.
        assert agg.data["bytes_transferred"] == [nb * n_layers * spec.page_size_bytes for nb in (1, 4)]
    finally:
        for e in engines:
            e.shutdown()


def test_prefill_restart_with_the_same_engine_id(connector_cls, dist_env):
    """The prefill instance restarts (same engine_id, new agent, new side
    channel port) after the decode has handshaken with it. The decode must
    not read through the dead agent's metadata: each request either fails
    cleanly or gets the right bytes, and requests succeed again (a new
    handshake) without restarting the decode."""
    engines = []
    try:
        p1 = h.Engine(connector_cls, "kv_producer", "engine-prefill-restart", 12)
        engines.append(p1)
        # A READ to the dead agent may never complete: transfer_timeout bounds it.
        d = h.Engine(
            connector_cls, "kv_consumer", "engine-decode-restart", 20, extra={"transfer_engine": "ucx", "transfer_timeout": 1.5}
        )
        engines.append(d)
        pre, dr, before = transfer(p1, d, "restart0", 40)
        wait_transfer_done(p1, d, pre, dr)
        assert_blocks_copied(p1, d, pre.block_ids, dr.new_blocks, before)
        finish_decode(d, dr)
        p1.shutdown()
        engines.remove(p1)
        p2 = h.Engine(connector_cls, "kv_producer", "engine-prefill-restart", 12)
        engines.append(p2)
        p2.fill_all(-9.0)
        ok = False
        for i in range(1, 3):
            pre, dr, before = transfer(p2, d, f"restart{i}", 40)
            h.run_until([p2, d], lambda: dr.req.request_id in d.out.recving, f"request {i} after the restart")
            if dr.req.request_id in d.out.failed:
                assert_kv_unchanged(d, before)
            else:
                assert_blocks_copied(p2, d, pre.block_ids, dr.new_blocks, before)
                ok = True
            finish_decode(d, dr)
            if ok:
                break
        assert ok, "no transfer from the restarted prefill succeeded in 2 requests"
    finally:
        for e in engines:
            e.shutdown()


def test_host_staging_moves_the_blocks_through_host_mirrors(connector_cls, dist_env, monkeypatch):
    """kv_buffer_device "cpu" for a KV cache in device memory (vLLM's
    use_host_buffer), run on CPU tensors through the test knob: each side
    registers pinned-host mirrors, the prefill copies the blocks its forward
    step computed into its mirror in wait_for_save, the decode's READ fills
    its mirror, and its blocks reach the "device" caches before
    finished_recving. A save or load at the wrong time reads the mirror's
    zeros and fails the byte comparison."""
    monkeypatch.setenv(gonixl.vllm.ENV_STAGING_ON_CPU, "1")
    engines = []
    try:
        p = h.Engine(connector_cls, "kv_producer", "engine-prefill-stage", P_BLOCKS)
        engines.append(p)
        d = h.Engine(connector_cls, "kv_consumer", "engine-decode-stage", D_BLOCKS)
        engines.append(d)
        for e in (p, d):
            host = e.worker._host
            assert host is not None, "staging did not turn on"
            for name, t in e.kv_caches.items():
                assert host.host_caches[name].data_ptr() != t.data_ptr()
                host.host_caches[name].zero_()
        p.fill_all(-7.0)
        d.fill_all(-3.0)
        pre, dr, before = transfer(p, d, "stage", 3 * h.BLOCK_SIZE + 5)
        # Saved in the forward step: exactly the request's blocks.
        for name, t in p.kv_caches.items():
            mirror = p.worker._host.host_caches[name]
            dim = p.worker._host.dims[name]
            idx = torch.tensor(pre.block_ids)
            assert torch.equal(mirror.index_select(dim, idx), t.index_select(dim, idx)), name
            others = torch.tensor([b for b in range(p.num_blocks) if b not in pre.block_ids])
            assert torch.count_nonzero(mirror.index_select(dim, others)) == 0, f"{name}: saved blocks outside the request"
        wait_transfer_done(p, d, pre, dr)
        assert dr.req.request_id not in d.out.failed
        assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
        assert not d.worker._recv_blocks, "blocks to load left behind after the request finished"
        finish_decode(d, dr)
    finally:
        for e in engines:
            e.shutdown()


# ----------------------------------------------------------------------
# A prefill of a smaller block size (vLLM's block_size_ratio)
# ----------------------------------------------------------------------


def _tokens_of(t: torch.Tensor, b: int) -> torch.Tensor:
    """Block b of a vLLM CPU cache ([blocks, heads, block_size, 2 *
    head_size], the vec kernels' layout: per head K column-major as
    [head_size, block_size], then V row-major as [block_size, head_size])
    as [token, head, K/V, dim], a copy."""
    _, heads, bs, two_d = t.shape
    d = two_d // 2
    blk = t[b].reshape(heads, 2, bs * d)
    k = blk[:, 0].reshape(heads, d, bs).permute(2, 0, 1)
    v = blk[:, 1].reshape(heads, bs, d).permute(1, 0, 2)
    return torch.stack([k, v], dim=2).clone()


def _set_tokens(t: torch.Tensor, b: int, x: torch.Tensor) -> None:
    """Writes x ([token, head, K/V, dim]) into block b as _tokens_of reads it."""
    _, heads, bs, two_d = t.shape
    d = two_d // 2
    blk = t[b].view(heads, 2, bs * d)
    blk[:, 0].copy_(x[:, :, 0].permute(1, 2, 0).reshape(heads, d * bs))
    blk[:, 1].copy_(x[:, :, 1].permute(1, 0, 2).reshape(heads, bs * d))


@pytest.mark.parametrize(
    "num_tokens,local_hit,engine",
    [(100, 0, "ucx"), (128, 0, "ucx"), (150, 1, "ucx"), (150, 1, "nixl")],
    ids=["100 tokens", "128 tokens", "150 tokens after a local hit", "150 tokens after a local hit, NIXL"],
)
def test_smaller_prefill_block_size_lands_in_token_order(connector_cls, dist_env, num_tokens, local_hit, engine):
    """A prefill of block size 32 and a decode of 64: every token of the
    prompt lands in the decode's block at its own position, for K and V of
    every head and layer (the READ puts two prefill blocks one after
    another into each decode block; the connector permutes them into the
    CPU vec kernels' order: K column-major, V row-major); positions the READ did not write are
    zeroed; blocks outside the request, and the decode's locally cached
    block, are untouched."""
    why = _engine_unavailable(engine)
    if why:
        pytest.skip(f"gonixl's {engine} transfer engine does not load on this host: {why}")
    extra = {"transfer_engine": engine}
    p = h.Engine(connector_cls, "kv_producer", "engine-p32", P_BLOCKS, extra=extra, block_size=32)
    d = None
    try:
        d = h.Engine(connector_cls, "kv_consumer", "engine-d64", D_BLOCKS, extra=extra, block_size=64)
        p.fill_all(-7.0)
        d.fill_all(-3.0)
        pre = h.prefill(p, "bs-p", num_tokens, seed=1)
        names = h.layer_names(p.vllm_config)
        gen = torch.Generator().manual_seed(num_tokens)
        tokens: dict[str, torch.Tensor] = {}
        for name in names:
            pt = p.kv_caches[name]
            heads, dim = pt.shape[1], pt.shape[3] // 2
            # The prompt's K/V by token position (the prefill's whole
            # blocks: what they hold past the prompt is read too).
            logical = torch.randn(len(pre.block_ids) * 32, heads, 2, dim, generator=gen)
            for k, b in enumerate(pre.block_ids):
                _set_tokens(pt, b, logical[k * 32 : (k + 1) * 32])
            assert torch.equal(_tokens_of(pt, pre.block_ids[0]), logical[:32])
            tokens[name] = logical
        before = d.snapshot()
        dr = h.schedule_decode(d, "bs-d", num_tokens, pre.params, local_hit_blocks=local_hit)
        assert dr.load_async and dr.n_ext == num_tokens - local_hit * 64
        wait_transfer_done(p, d, pre, dr)
        assert "bs-d" not in d.out.failed
        start = local_hit * 64  # first position read
        written = len(pre.block_ids) * 32 - start  # positions the READ covered
        for name in names:
            dt = d.kv_caches[name]
            for k, b in enumerate(dr.new_blocks):
                pos0 = start + k * 64
                n = max(0, min(64, start + written - pos0))
                want = torch.zeros(64, dt.shape[1], 2, dt.shape[3] // 2)
                want[:n] = tokens[name][pos0 : pos0 + n]
                got = _tokens_of(dt, b)
                assert torch.equal(got, want), f"{name}: decode block {b} (positions {pos0}..{pos0 + 63})"
            others = [x for x in range(d.num_blocks) if x not in set(dr.new_blocks)]
            idx = torch.tensor(others, dtype=torch.long)
            assert torch.equal(d.kv_caches[name].index_select(0, idx), before[name].index_select(0, idx)), name
        finish_decode(d, dr)
    finally:
        if d is not None:
            d.shutdown()
        p.shutdown()


def test_larger_prefill_block_size_is_refused(connector_cls, dist_env):
    """A prefill whose blocks are larger than the decode's: the handshake
    refuses it (as vLLM's NixlConnector does), the request fails loudly,
    and the decode's KV cache is untouched."""
    p = h.Engine(connector_cls, "kv_producer", "engine-p64", P_BLOCKS, block_size=64)
    d = None
    try:
        d = h.Engine(connector_cls, "kv_consumer", "engine-d32", D_BLOCKS, block_size=32)
        d.fill_all(-3.0)
        pre = h.prefill(p, "big-p", 100, seed=2)
        before = d.snapshot()
        dr = h.schedule_decode(d, "big-d", 100, pre.params)
        h.run_until([p, d], lambda: "big-d" in d.out.recving, "the refused request reported")
        assert "big-d" in d.out.failed
        assert_kv_unchanged(d, before)
    finally:
        if d is not None:
            d.shutdown()
        p.shutdown()


def test_idle_steps_make_no_call_into_the_library(connector_cls, dist_env, monkeypatch):
    """An engine step with nothing in flight or held, and no metadata,
    reads the worker's published state (busy, change counter) and makes no
    call into the library on either side; a step with work calls in and
    gets every result (issue: per-step cost)."""
    p = h.Engine(connector_cls, "kv_producer", "engine-idle-p", P_BLOCKS)
    d = h.Engine(connector_cls, "kv_consumer", "engine-idle-d", D_BLOCKS)
    try:
        _idle_steps(p, d, monkeypatch)
    finally:
        p.shutdown()
        d.shutdown()


def _count_library_calls(monkeypatch) -> list[str]:
    """From now on, the name of every C function the binding calls, in
    order (through _lib.call, call_bytes and call_into)."""
    from gonixl import _lib

    calls: list[str] = []
    for name in ("call", "call_bytes", "call_into"):
        real = getattr(_lib, name)

        def counting(*args, _real=real, **kw):
            calls.append(next((a for a in args[:2] if isinstance(a, str)), "?"))
            return _real(*args, **kw)

        monkeypatch.setattr(_lib, name, counting)
    return calls


def _idle_steps(p, d, monkeypatch):
    p.fill_all(-7.0)
    d.fill_all(-3.0)
    pre, dr, before = transfer(p, d, "idle1", 40)
    wait_transfer_done(p, d, pre, dr)
    finish_decode(d, dr)
    h.run_steps([p, d], 3)  # everything reported: both sides idle

    calls = _count_library_calls(monkeypatch)
    h.run_steps([p, d], 20)
    assert calls == [], f"idle steps called into the library: {calls}"
    # Work again: the calls come back, and nothing was lost meanwhile.
    pre, dr, before = transfer(p, d, "idle2", 40)
    wait_transfer_done(p, d, pre, dr)
    assert "gonixl_worker_get_finished" in calls and "gonixl_scheduler_build_meta" in calls
    assert_blocks_copied(p, d, pre.block_ids, dr.new_blocks, before)
    finish_decode(d, dr)


def test_per_request_scheduler_calls_ride_the_steps_crossing(connector_cls, dist_env, monkeypatch):
    """A decode's per-request scheduler calls whose answer vLLM does not
    wait for (on_new_request, update_state_after_alloc, request_finished,
    update_connector_output) make no call into the library of their own:
    they go with the step's build_connector_meta, one call, and nothing is
    lost (the KV arrives, the prefill is told, everything ends at rest).
    Only get_num_new_matched_tokens, whose answer vLLM needs at once,
    crosses by itself on a decode; on a prefill only request_finished does
    (issue: per-step cost)."""
    p = h.Engine(connector_cls, "kv_producer", "engine-batch-p", P_BLOCKS)
    d = h.Engine(connector_cls, "kv_consumer", "engine-batch-d", D_BLOCKS)
    try:
        calls = _count_library_calls(monkeypatch)
        d.fill_all(-3.0)
        pres = [h.prefill(p, f"batch{i}-p", 40 + 8 * i, seed=i) for i in range(3)]
        # A prefill's request crosses for its step and for request_finished
        # (whose answer vLLM needs): get_num_new_matched_tokens, whose
        # answer is (0, False) there, makes no call.
        sched_calls = [c for c in calls if c.startswith("gonixl_scheduler_")]
        assert sched_calls == ["gonixl_scheduler_apply_build_meta", "gonixl_scheduler_request_finished"] * 3, sched_calls
        before = d.snapshot()
        calls.clear()
        drs = [h.schedule_decode(d, f"batch{i}-d", 40 + 8 * i, pre.params) for i, pre in enumerate(pres)]
        assert calls == ["gonixl_scheduler_get_num_new_matched_tokens"] * 3, calls
        assert d.sched._sched.pending_ops == 6  # on_new_request + update_state_after_alloc each
        d.step()
        sched_calls = [c for c in calls[3:] if c.startswith("gonixl_scheduler_")]
        assert sched_calls == ["gonixl_scheduler_apply_build_meta"], sched_calls
        assert all(dr.req.kv_transfer_params["do_remote_prefill"] is False for dr in drs)
        for pre, dr in zip(pres, drs):
            wait_transfer_done(p, d, pre, dr)
        src = [b for pre in pres for b in pre.block_ids]
        assert_blocks_copied(p, d, src, [b for dr in drs for b in dr.new_blocks], before)
        calls.clear()
        for dr in drs:
            dr.req.status = RequestStatus.FINISHED_STOPPED
            assert d.sched.request_finished(dr.req, dr.local_hit + dr.new_blocks) == (False, None)
            d.free(dr.local_hit + dr.new_blocks)
            d.finished_req_ids.add(dr.req.request_id)
        assert calls == [], calls
        # An abort before the load: the prefill is told to free its blocks
        # by the next step, with no call of its own.
        pre = h.prefill(p, "batch-abort-p", 40, seed=9)
        req = d.request("batch-abort-d", 40, copy.deepcopy(pre.params))
        d.add_request(req)
        req.status = RequestStatus.FINISHED_ABORTED
        calls.clear()
        assert d.sched.request_finished(req, []) == (False, None)
        assert calls == [], calls
        h.run_until([p, d], lambda: "batch-abort-p" in p.out.sending, "the prefill freed the aborted request's blocks")
        h.run_steps([p, d], 3)
        live = d.sched.live_counts()
        assert live["awaiting_kv"] == 0 and live["heartbeat_leases"] == 0, live
    finally:
        d.shutdown()
        p.shutdown()


def test_steps_between_heartbeats_make_no_call(connector_cls, dist_env, monkeypatch):
    """A decode whose only pending work is a heartbeat to the prefill holding
    blocks for it (a request queued behind others): the steps between two
    heartbeats make no call into the library, and the step at the next
    heartbeat's due time makes one that carries it (issue: per-step cost).
    Heartbeats every kv_lease_duration // 6 = 1 s here."""
    extra = {"transfer_engine": "ucx", "kv_lease_duration": 6}
    p = h.Engine(connector_cls, "kv_producer", "engine-hb-p", P_BLOCKS, extra=extra)
    d = h.Engine(connector_cls, "kv_consumer", "engine-hb-d", D_BLOCKS, extra=extra)
    try:
        pre = h.prefill(p, "hb1", 40, seed=3)
        d.add_request(d.request("hb-d", 40, copy.deepcopy(pre.params), max_tokens=4))
        from gonixl import _lib

        sizes: list[tuple[str, int]] = []
        real, real_into = _lib.call_bytes, _lib.call_into

        def counting(name, *args, **kw):
            out = real(name, *args, **kw)
            sizes.append((name, len(out)))
            return out

        def counting_into(b, name, *args, **kw):
            out = real_into(b, name, *args, **kw)
            sizes.append((name, len(out)))
            return out

        monkeypatch.setattr(_lib, "call_bytes", counting)
        monkeypatch.setattr(_lib, "call_into", counting_into)
        # Until a heartbeat has gone out and the step after it found nothing
        # to do (its idle_for names the next one).
        deadline = time.monotonic() + 10
        while not (len(sizes) >= 2 and sizes[-2][1] > 0 and sizes[-1] == ("gonixl_scheduler_build_meta", 0)):
            assert time.monotonic() < deadline, f"no heartbeat, then an idle step: {sizes}"
            h.run_steps([d], 1)
            time.sleep(0.05)
        t_idle = time.monotonic()
        sizes.clear()
        h.run_steps([d], 20)
        if time.monotonic() - t_idle < 0.9:  # all before the next heartbeat
            assert sizes == [], f"steps between heartbeats called into the library: {sizes}"
        time.sleep(max(0.0, t_idle + 1.1 - time.monotonic()))
        h.run_steps([d], 1)
        assert sizes and sizes[0][0] == "gonixl_scheduler_build_meta" and sizes[0][1] > 0, (
            f"the step at the heartbeat's due time made no call, or one without the heartbeat: {sizes}"
        )
    finally:
        d.shutdown()
        p.shutdown()


def test_kv_digest_fails_the_load_of_a_block_changed_after_its_prompt(pd):
    """The prefill digests its blocks in the step that completes the prompt
    (after the forward, through the worker metadata into the params
    request_finished returned); a block whose KV changed after that (given
    to another request under the lease, a partial write) fails the decode's
    load, its blocks as load errors; the unchanged request before it loads."""
    p, d = pd
    pre, dr, _ = transfer(p, d, "digest-ok", 70)
    wait_transfer_done(p, d, pre, dr)
    assert "digest-ok-d" not in d.out.failed
    finish_decode(d, dr)

    pre = h.prefill(p, "digest-bad-p", 70, seed=3)
    assert "gonixl_kv_digest" in pre.params
    p.fill_block(pre.block_ids[1], 0.5)  # after the digest, before the READ
    dr = h.schedule_decode(d, "digest-bad-d", 70, pre.params)
    h.run_until([p, d], lambda: "digest-bad-d" in d.out.recving, "the changed block's load to end")
    assert "digest-bad-d" in d.out.failed
    assert set(dr.new_blocks) <= d.out.invalid_until_recv("digest-bad-d")
    finish_decode(d, dr)


def test_extra_bool_reads_as_the_library():
    """kv_connector_extra_config booleans read as shim/config.go reads them
    (TestConfigExtraBool has the same table): the connector batches a
    decode's request_finished only where both sides see bidirectional
    transfer off."""
    for v, want in [
        (None, False), (True, True), (False, False), ("yes", True), ("On", True), (" true ", True), ("0", False),
        ("off", False), ("", False), (1, True), (0, False), (0.0, False), (2, True), (-0.0, False),
    ]:
        assert gonixl.vllm._extra_bool(v) is want, (v, want)
