"""Pipeline parallelism one level down: vLLM's CPU backend does not serve
--pipeline-parallel-size 2 on this machine (docs/GEOMETRIES.md), so two
stages are built here from vLLM's real config objects and real KV-cache
tensors: per engine one SCHEDULER GoNixlConnector and one WORKER per stage,
each worker holding its stage's layers and its pp_rank, their handshake blobs
served per (pp_rank, tp_rank) as vLLM's executor hands them over. A decode
stage must read its layers from the prefill's worker of the same stage.

Run by pytest tests/python (needs the .venv with vLLM and the built library).
"""

from __future__ import annotations

import os
import pickle
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

from test_connector import connector_cls, dist_env  # noqa: E402,F401  (fixtures)

import connector_harness as h  # noqa: E402
import torch  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

NUM_BLOCKS = 24


class TwoStageEngine:
    """One vLLM instance with pipeline_parallel_size 2 (TP 1): the fixture
    model's layer 0 on stage 0, layer 1 on stage 1."""

    def __init__(self, connector_cls, kv_role: str, engine_id: str, fill: float, monkeypatch):
        import gonixl.vllm as gv

        self.port = h.free_port()
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(self.port))
        self.vc = h.make_vllm_config(kv_role, engine_id, {"transfer_engine": "ucx"})
        self.vc.parallel_config.pipeline_parallel_size = 2
        layout = h.resolve_layout_cpu(self.vc)
        self.kcc = h.make_kv_cache_config(self.vc, NUM_BLOCKS)
        self.kcc.kv_cache_layout = layout.name
        caches = allocate_kv_cache(self.kcc, torch.device("cpu"), layout)
        names = h.layer_names(self.vc)
        assert len(names) == 2
        for i, n in enumerate(names):
            caches[n].copy_(torch.full_like(caches[n], fill + i))
        self.stage_caches = [{names[0]: caches[names[0]]}, {names[1]: caches[names[1]]}]
        self.workers = []
        blobs = {}
        with h.set_current_vllm_config(self.vc):
            for pp, kv in enumerate(self.stage_caches):
                monkeypatch.setattr(gv, "_pp_rank", lambda role, pp=pp: pp if role == "worker" else 0)
                w = connector_cls(self.vc, KVConnectorRole.WORKER, self.kcc)
                self.workers.append(w)
                w.register_kv_caches(kv)
                blobs[(pp, 0)] = pickle.loads(pickle.dumps(w.get_handshake_metadata()))
            self.sched = connector_cls(self.vc, KVConnectorRole.SCHEDULER, self.kcc)
            self.sched.set_xfer_handshake_metadata_pp_aware(blobs)
        self.sending: list[set[str]] = [set(), set()]
        self.recving: list[set[str]] = [set(), set()]
        self.failed: set[str] = set()

    def step(self) -> None:
        meta = self.sched.build_connector_meta(SchedulerOutput.make_empty())
        for pp, w in enumerate(self.workers):
            w.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
            w.start_load_kv(None)
            r = w.get_transfer_results(set())
            w.clear_connector_metadata()
            self.sending[pp] |= r.finished_sending
            self.recving[pp] |= r.finished_recving
            self.failed |= r.failed_recving

    def shutdown(self) -> None:
        for c in [*self.workers, self.sched]:
            c.shutdown()


def test_decode_stages_read_their_own_layers_from_the_same_prefill_stage(connector_cls, dist_env, monkeypatch):  # noqa: F811
    p = TwoStageEngine(connector_cls, "kv_producer", "engine-pp-prefill", 10.0, monkeypatch)
    d = TwoStageEngine(connector_cls, "kv_consumer", "engine-pp-decode", -50.0, monkeypatch)
    try:
        n_tokens = 70  # 3 blocks
        req = h.Engine.request("pp-p", n_tokens, dict(h.PROXY_PREFILL_PARAMS))
        p.sched.on_new_request(req)
        assert p.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        p_blocks = [3, 4, 5]
        p.sched.update_state_after_alloc(req, KVCacheBlocks(([h.KVCacheBlock(b) for b in p_blocks],)), 0)
        p.step()
        req.num_computed_tokens = n_tokens
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p.sched.request_finished(req, p_blocks)
        assert delay and params["pp_size"] == 2
        p.step()

        dreq = h.Engine.request("pp-d", n_tokens, params, max_tokens=4)
        d.sched.on_new_request(dreq)
        n_ext, is_async = d.sched.get_num_new_matched_tokens(dreq, 0)
        assert (n_ext, is_async) == (n_tokens, True)
        d_blocks = [7, 8, 9]
        d.sched.update_state_after_alloc(dreq, KVCacheBlocks(([h.KVCacheBlock(b) for b in d_blocks],)), n_ext)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            d.step()
            p.step()
            if all("pp-d" in r for r in d.recving) and all("pp-p" in s for s in p.sending):
                break
            time.sleep(0.01)
        assert not d.failed, d.failed
        assert all("pp-d" in r for r in d.recving), d.recving
        assert all("pp-p" in s for s in p.sending), f"every prefill stage frees on its decode stage's notification: {p.sending}"
        for pp in range(2):
            for name, dt in d.stage_caches[pp].items():
                pt = p.stage_caches[pp][name]
                for pb, db in zip(p_blocks, d_blocks):
                    assert torch.equal(dt[db], pt[pb]), f"stage {pp} {name}: decode block {db} != prefill block {pb}"
                assert not torch.equal(dt[6], pt[2]), "a block outside the request changed"
    finally:
        p.shutdown()
        d.shutdown()
