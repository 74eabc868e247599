"""GoNixlConnector: vLLM's KV connector interface in front of libgonixl.so.

vLLM loads it with::

    --kv-transfer-config '{"kv_connector": "GoNixlConnector",
                           "kv_connector_module_path": "gonixl.vllm",
                           "kv_role": "kv_producer", ...}'

This class only flattens vLLM objects (request ids, token counts,
kv_transfer_params, block ids, tensor geometry) into bytes and integer
arrays and calls the library. All connector state -- request state
machine, leases, heartbeats, handshakes, transfers, stats -- lives in Go.
The library is loaded on first use in the process that uses it (vLLM forks
its workers; a Go runtime does not survive fork).
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import os
import platform
import struct
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, cast

import msgspec
import torch

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id
from vllm.logger import init_logger

from . import _lib, errors
from .digest import READBACK_DIGEST_KEY, READBACK_TOKENS_KEY, DigestError, matched_tokens, token_bytes, token_digest
from .engine import BlockReshaper, HostStaging, Scheduler, Worker, layer_descriptions
from .push_admission import PushAdmission, default_budget, prompt_blocks

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

_T = TypeVar("_T")

#: How long a push decode keeps vLLM stepping after it finished a request
#: whose blocks its worker still holds (push_recv.go): a live gonixl
#: prefill answers a cancel within a step, and the worker asks again every
#: 5 s and probes the prefill at 30 s.
_PUSH_HOLD_STEPPING = 60.0

# Linux x86_64: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _request_amx_tile_permission() -> None:
    """Ask Linux for AMX tile-data permission for this (worker) process.

    vLLM's CPU attention backend picks its AMX kernel for bfloat16 whenever
    the CPU has AMX (cpu_attn.py checks CPUID only) and executes tile
    instructions without asking the kernel for the permission Linux requires
    (ARCH_REQ_XCOMP_PERM); it relies on oneDNN having asked during an earlier
    GEMM big enough to select an AMX kernel. A decode worker whose first
    forward step follows a KV transfer computes a single new token, no GEMM
    asks, and the first tile instruction dies with SIGILL. The permission is
    process-wide and idempotent. It is requested before this connector loads
    libgonixl.so, so that in a worker process no Go or UCX thread exists yet
    when the kernel checks every thread's signal stack against the larger
    AMX signal frame (ENOSPC otherwise).
    """
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or not torch.cpu._is_amx_tile_supported():
            return
    except (ImportError, AttributeError):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM), ctypes.c_long(_XFEATURE_XTILEDATA))
    if rc != 0:
        e = ctypes.get_errno()
        logger.warning(
            "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: %s; vLLM's bfloat16 AMX attention may die with SIGILL",
            os.strerror(e),
        )


class GoNixlConnectorMetadata(KVConnectorMetadata):
    """One step's scheduler -> worker metadata: opaque bytes made by Go,
    and with host staging (kv_buffer_device "cpu" for device caches) the
    blocks to copy: save, per request, the blocks this step computes for a
    remote decode (device -> host, in wait_for_save); recv, per request,
    the blocks a READ fills (host -> device once it is done)."""

    def __init__(
        self,
        data: bytes,
        save: Optional[dict[str, list[int]]] = None,
        recv: Optional[dict[str, list[int]]] = None,
        push_early: bool = False,
        preempted: bool = False,
        digest: Optional[list[dict[str, Any]]] = None,
    ):
        self.data = data
        self.save = save or {}
        self.recv = recv or {}
        # Push mode: this step completes prompts whose WRITE the workers
        # post once its forward is done (gonixl_scheduler_push_prompt_done).
        self.push_early = push_early
        # Push mode: announced prompts vLLM preempted; the workers fence
        # their WRITEs in handle_preemptions, before the step's forward.
        self.preempted = preempted
        # Pull mode, a prefill: the requests whose prompt this step
        # completes ({"id", "tokens", "blocks"}): the workers digest their
        # blocks after the forward (gonixl_worker_kv_digest).
        self.digest = digest or []


#: Test knob: host staging on vLLM's CPU platform, where vLLM never stages
#: (its KV cache is host memory already); the copies are then CPU to CPU,
#: which lets the CPU test suite check when they happen.
ENV_STAGING_ON_CPU = "GONIXL_TEST_HOST_STAGING_ON_CPU"


def _host_staging(vllm_config: VllmConfig) -> bool:
    """vLLM's use_host_buffer: kv_buffer_device "cpu" on a device platform."""
    from vllm.platforms import current_platform

    ktc = vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_buffer_device != "cpu":
        return False
    return current_platform.device_type != "cpu" or os.environ.get(ENV_STAGING_ON_CPU) == "1"


class GoNixlWorkerMeta(KVConnectorWorkerMetadata):
    """A worker's word to its scheduler for one step: the base request ids
    of the push registrations that arrived (push_admission.py), and the KV
    digests of the prompts the step completed, by request id and tp rank;
    the workers' words are merged (any rank's registration claims a
    request; each rank adds its digests)."""

    def __init__(self, push_arrivals: frozenset[str], digests: Optional[dict[str, dict[int, Any]]] = None):
        self.push_arrivals = push_arrivals
        self.digests = digests or {}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, GoNixlWorkerMeta):
            return self
        digests = {rid: dict(ranks) for rid, ranks in self.digests.items()}
        for rid, ranks in other.digests.items():
            digests.setdefault(rid, {}).update(ranks)
        return GoNixlWorkerMeta(self.push_arrivals | other.push_arrivals, digests)


class GoNixlHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's encoded NixlHandshakePayload, served by the scheduler's
    side-channel listener."""

    def __init__(self, payload: bytes):
        self.payload = payload


# gonixl's addition to the prefill's kv_transfer_params: a digest of the
# prompt tokens whose KV its blocks hold. A gonixl decode checks it against
# its own prompt before it uses the blocks, so parameters that belong to
# another request (a proxy mix-up, a client replaying someone else's) are
# never computed from. vLLM's stock connector ignores unknown keys; params
# from a stock prefill carry no digest and are unchecked.
PROMPT_DIGEST_KEY = "gonixl_prompt_digest"
#: A pull prefill's digests of the KV of the blocks its params name
#: (shim/kvwire/kvdigest.go, docs/PROTOCOL.md).
KV_DIGEST_KEY = "gonixl_kv_digest"
#: On a bidirectional decode's params: the digests of the blocks they name
#: are served on its side channel (shim/kvdigest_readback.go).
KV_DIGEST_SERVED_KEY = "gonixl_kv_digest_served"
#: Seconds a decode waits for its workers' digests of a held request before
#: it serves the request as not digested.
_READBACK_DIGEST_WAIT = 10.0


def _last_places(groups: Any) -> list[list[int]]:
    """Block ids per group as lists, a block id listed twice (a
    sliding-window block freed and given back to the same request) kept at
    its last position only (-1 elsewhere: not digested)."""
    out = [list(g) for g in groups]
    for g in out:
        last = {b: j for j, b in enumerate(g)}
        g[:] = [b if last[b] == j else -1 for j, b in enumerate(g)]
    return out


def _digest_places(ids: Sequence[int], digested: list[int]) -> Optional[tuple[int, Optional[list[Optional[int]]], bool]]:
    """Where the params' block list ids (one group) sits in the prompt's
    digested blocks: (first, place, whole), or None when ids are not one
    run of them. Block j of ids sits at prompt position first + j; place[j]
    is its index in digested, None where it was not digested there (a
    sliding-window group's null block, a block past the prompt: digest 0,
    not checked), and place is None when it is every index in order (the
    params name the prompt's blocks as they were digested, the usual
    case); whole says whether ids cover every digested block."""
    if len(ids) == len(digested) and list(ids) == digested and -1 not in digested and len(set(digested)) == len(digested):
        return 0, None, True
    return _search_places(ids, digested)


def _search_places(ids: Sequence[int], digested: list[int]) -> Optional[tuple[int, Optional[list[Optional[int]]], bool]]:
    """_digest_places without its shortcut: every block looked up."""
    pos_of = {b: j for j, b in enumerate(digested) if b >= 0}
    starts = {pos_of[b] - k for k, b in enumerate(ids) if b in pos_of}
    if len(starts) > 1:
        return None
    start = starts.pop() if starts else 0
    at = [start + k if 0 <= start + k < len(digested) and digested[start + k] == b else None for k, b in enumerate(ids)]
    return start, at, start == 0 and len(ids) == len(pos_of) and None not in at


def _placed(digests: Sequence[int], place: Optional[list[Optional[int]]], n: int) -> Sequence[int]:
    """The digests of the params' n blocks (_digest_places's place)."""
    if place is None:
        return digests if len(digests) == n else [digests[j] for j in range(n)]
    return [0 if j is None else digests[j] for j in place]


def _pack_u64(values: Sequence[int]) -> str:
    """64-bit digests as kv_transfer_params carry them: base64 of
    little-endian uint64s."""
    return base64.b64encode(struct.pack(f"<{len(values)}Q", *values)).decode()


# A gonixl decode's params carry the wall-clock end of its blocks' TTL (no
# stock engine sends it): params with it come from a gonixl decode.
EXPIRY_UNIX_KEY = "gonixl_expiry_unix"


def prompt_digest(token_ids: Any, n: int) -> Optional[str]:
    """The digest of the first n prompt token ids, or None without ids."""
    if token_ids is None or n <= 0 or n > len(token_ids):
        return None
    h = hashlib.blake2b(token_bytes(token_ids, n), digest_size=16)
    return "blake2b-128:" + h.hexdigest()


def _with_digest(params: dict[str, Any], token_ids: Any, n: int) -> Optional[bytes]:
    """params as JSON with the digest of the first n prompt tokens added,
    or None when there is no digest (no token ids)."""
    digest = prompt_digest(token_ids, n)
    if digest is None:
        return None
    return _encode_params({**params, PROMPT_DIGEST_KEY: digest})


def _extra_bool(v: Any) -> bool:
    """A boolean of kv_connector_extra_config as the library reads it
    (shim/config.go: a bool, a string, a number that is not 0): the two
    sides must agree on the mode."""
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1", "yes", "on")
    return bool(v)


def _params_enc_hook(o: Any) -> Any:
    raise TypeError(f"kv_transfer_params value of type {type(o).__name__} is not JSON serialisable")


# A request's params are encoded on each scheduler call about it (several
# per request): msgspec (a vLLM dependency) does it in a tenth of the
# time of json.dumps (about 3 against 29 µs for a 32-block pull's params
# with digests); the library parses them once per distinct bytes.
_params_encoder = msgspec.json.Encoder(enc_hook=_params_enc_hook)


def _encode_params(params: dict[str, Any]) -> bytes:
    return _params_encoder.encode(params)


def _params_json(request: "Request") -> bytes:
    p = request.kv_transfer_params
    if not p:
        return b""
    return _encode_params(p)


def _json_default(o: Any):
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"kv_transfer_params value of type {type(o).__name__} is not JSON serialisable")


def _compat_factors(vllm_config: VllmConfig, transfer_mode: str = "pull") -> dict[str, Any]:
    """The factors of vLLM's NIXL compatibility hash, minus the ones the
    library adds (connector version, attention backend)."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as nixl_md

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    spec = None
    if hasattr(nixl_md, "_get_speculative_compatibility_factors"):
        spec = nixl_md._get_speculative_compatibility_factors(vllm_config)
    return {
        "vllm_version": vllm.__version__,
        "model": mc.model,
        "dtype": str(mc.dtype),
        "num_kv_heads": mc.get_total_num_kv_heads(),
        "head_size": mc.get_head_size(),
        "num_hidden_layers": mc.get_total_num_hidden_layers(),
        "cache_dtype": str(cc.cache_dtype),
        "is_hma_enabled": not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "speculative_config": spec,
        "transfer_mode": transfer_mode,
    }


def _spec_kind(spec: Any) -> tuple[str, int]:
    """A KV-cache spec as gonixl's Go side names it: (kind, sliding window
    in tokens). Kinds other than full / sliding_window / mla are refused by
    the library with the kind in the message."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {_spec_kind(s) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else ("mixed:" + ",".join(sorted(k for k, _ in kinds)), 0)
    if isinstance(spec, MLAAttentionSpec):
        return "mla", 0
    if type(spec) is SlidingWindowSpec:
        return "sliding_window", int(spec.sliding_window)
    if type(spec) is FullAttentionSpec:
        return "full", 0
    return type(spec).__name__, 0


def _transfer_groups(vllm_config: VllmConfig, kv_cache_config: "KVCacheConfig") -> tuple[list[dict[str, Any]], bool]:
    """vLLM's transfer groups (kind, window, block size) and whether its
    NixlConnector would treat the model as hybrid (_is_hma_required)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.transfer_groups
    out = []
    for g in groups:
        kind, window = _spec_kind(g.kv_cache_spec)
        out.append({"kind": kind, "sliding_window": window, "block_size": int(g.kv_cache_spec.block_size)})
    hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and any(
        not isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups
    )
    return out, hma


def _layer_specs(kv_cache_config: "KVCacheConfig") -> dict[str, tuple[int, str, int]]:
    """Layer name -> (transfer group index, kind, sliding window), for the
    layers with a cache spec of their own (as vLLM's NixlConnector lists them)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    out: dict[str, tuple[int, str, int]] = {}
    for gi, g in enumerate(kv_cache_config.transfer_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            for name, s in spec.kv_cache_specs.items():
                out[name] = (gi, *_spec_kind(s))
        else:
            kind = _spec_kind(spec)
            for name in g.layer_names:
                out[name] = (gi, *kind)
    return out


def _config_json(
    vllm_config: VllmConfig,
    role: str,
    kv_cache_config: Optional["KVCacheConfig"] = None,
    transfer_mode: str = "pull",
    kv_digest_readback: bool = False,
) -> bytes:
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None  # vLLM builds a connector only from a kv_transfer_config
    pc = vllm_config.parallel_config
    from vllm import envs

    cfg = {
        "role": role,
        "kv_role": ktc.kv_role,
        "engine_id": ktc.engine_id,
        "kv_buffer_device": ktc.kv_buffer_device,
        "kv_load_failure_policy": getattr(ktc, "kv_load_failure_policy", "fail"),
        "enable_permute_local_kv": bool(getattr(ktc, "enable_permute_local_kv", False)),
        "tp_size": pc.tensor_parallel_size,
        "tp_rank": _tp_rank(role),
        "pp_size": pc.pipeline_parallel_size,
        "pp_rank": _pp_rank(role),
        "dp_index": getattr(pc, "data_parallel_index", 0) or 0,
        "block_size": vllm_config.cache_config.block_size,
        "side_channel_host": envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
        "side_channel_port": envs.VLLM_NIXL_SIDE_CHANNEL_PORT,
        "kv_connector_extra_config": ktc.kv_connector_extra_config or {},
        "transfer_mode": transfer_mode,
        "kv_digest_readback": kv_digest_readback,
    }
    if kv_cache_config is not None:
        cfg["transfer_groups"], cfg["hma_required"] = _transfer_groups(vllm_config, kv_cache_config)
    if role == "worker":
        cfg["compat_factors"] = _compat_factors(vllm_config, transfer_mode)
    return json.dumps(cfg, default=_json_default).encode()


def _block_kind(vllm_config: VllmConfig, backend: str, layout: Any) -> tuple[str, str]:
    """How this engine's KV blocks are laid out inside: the BlockReshaper
    kind ("" when not known) and, for the CPU backend, the kernel layout,
    which depends on the ISA vLLM picks for the dtype, block size and host
    (the handshake refuses a peer of another)."""
    if backend == "CPU_ATTN":
        from vllm.v1.attention.backends import cpu_attn

        mc = vllm_config.model_config
        if not isinstance(mc.dtype, torch.dtype):  # resolved by ModelConfig; else unknown
            return "", "cpu_attn:unknown"
        isa = cpu_attn._get_attn_isa(
            mc.dtype, vllm_config.cache_config.block_size, mc.get_head_size(), vllm_config.cache_config.cache_dtype
        )
        # vec16 writes the cache as vec does: K column-major, V row-major.
        family = "vec" if isa in ("vec", "vec16") else isa
        return ("cpu_vec" if family == "vec" else ""), f"cpu_attn:{family}"
    if layout.is_block_contiguous:
        return "head_major", ""
    if tuple(layout.value[-3:]) == (3, 2, 4):  # tokens outside heads: NHD
        return "token_major", ""
    return "", ""


def _tp_rank(role: str) -> int:
    if role != "worker":
        return 0
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group().rank_in_group


def _pp_rank(role: str) -> int:
    if role != "worker":
        return 0
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank_in_group


class GoNixlConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector (pull mode, as NixlConnector) backed by libgonixl.so."""

    # "pull": the decode READs (vLLM's NixlConnector); GoNixlPushConnector
    # sets "push" (vLLM's NixlPushConnector).
    _TRANSFER_MODE = "pull"

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None and ktc.engine_id is not None
        if ktc.kv_role == "kv_both":
            logger.warning(
                "Using kv_role='kv_both' with GoNixlConnector is deprecated: set kv_role='kv_producer' "
                "on prefill instances and kv_role='kv_consumer' on decode instances."
            )
        self.engine_id = ktc.engine_id
        self.kv_cache_config = kv_cache_config
        # The library's two sides, through its one binding (gonixl.engine).
        self._sched: Optional[Scheduler] = None
        self._worker: Optional[Worker] = None
        self._handshake: Optional[GoNixlHandshakeMetadata] = None
        # Host staging (vLLM's use_host_buffer): the scheduler lists the
        # blocks to copy, the worker copies through pinned host mirrors.
        self._staging = _host_staging(vllm_config)
        extra = ktc.kv_connector_extra_config or {}
        bidirectional = _extra_bool(extra.get("bidirectional_kv_xfer"))
        self._bidirectional = bidirectional
        if self._staging and bidirectional:
            # A decode stages only the blocks a prefill computed for it: its
            # own tokens' KV never reaches the host mirror a later turn
            # would read back.
            raise ValueError(
                "bidirectional_kv_xfer with host staging (kv_buffer_device cpu on a device platform) is not supported"
            )
        # A bidirectional prefill reads a turn back into blocks vLLM may
        # have freed under a step still in flight (vLLM defers frees only on
        # consumers): on a device, its loads wait for the device first.
        self._sync_before_load = bidirectional and ktc.kv_role != "kv_consumer"
        self._need_save: dict[str, "Request"] = {}
        self._save_tails: dict[str, list[int]] = {}  # each group's last block saved so far (_staging_saves)
        self._stage_recv: dict[str, list[int]] = {}
        self._host: Optional[HostStaging] = None
        self._recv_blocks: dict[str, list[int]] = {}
        self._block_size = int(vllm_config.cache_config.block_size)
        self._warned_no_digest = False
        self._warned_digest = False
        # Push mode, scheduler side (has_pending_push_work): prefill
        # requests whose blocks wait for their WRITE, decode registrations
        # not yet handed to the worker, decode requests registered and not
        # received, and those vLLM finished (an abort, a failed wait) before
        # their finished_recving: the worker holds their blocks until no
        # WRITE can land (the prefill's answer comes in a later step), and
        # vLLM steps an engine without requests no more, so it is kept
        # stepping for up to _PUSH_HOLD_STEPPING seconds (after that the
        # next request's steps end the hold).
        self._push_sending: set[str] = set()
        self._push_registering: set[str] = set()
        self._push_registered: set[str] = set()
        self._push_unreceived: dict[str, float] = {}
        # Push mode, a prefill: requests for a remote decode whose blocks
        # can be WRITTEN as soon as the step that completes their prompt has
        # run, before vLLM finishes them (gonixl_scheduler_push_prompt_done):
        # max_tokens 1, so that step finishes them, and full-attention
        # transfer groups only (a sliding-window group frees blocks as the
        # prompt advances). The blocks so far, per KV-cache group; and every
        # id ever tracked, until its request_finished: a request resumed
        # after a preemption is not tracked again (the library has the
        # announced ones, holds preemption off while they run, and fences
        # those vLLM preempts anyway: gonixl_scheduler_push_preempted).
        groups, _ = _transfer_groups(vllm_config, kv_cache_config)
        self._groups = groups
        self._push_early_ok = (
            self._TRANSFER_MODE == "push"
            and role == KVConnectorRole.SCHEDULER
            and not self._staging
            and bool(groups)
            and all(g["kind"] in ("full", "mla") for g in groups)
        )
        self._push_early: dict[str, tuple["Request", list[list[int]]]] = {}
        self._push_early_seen: set[str] = set()
        # Push mode, a prefill: admission of requests whose decode has not
        # registered yet (push_admission.py: the two sides must not wait on
        # each other under KV-cache pressure); the registrations reach it
        # from the workers (GoNixlWorkerMeta). On a worker: the base ids
        # that arrived, for the step's worker metadata.
        self._admission: Optional[PushAdmission] = None
        if self._TRANSFER_MODE == "push" and role == KVConnectorRole.SCHEDULER and ktc.kv_role != "kv_consumer":
            # Every KV-cache group draws from one pool: a prompt takes a
            # block per group's block size in each.
            sizes = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups] or [self._block_size]

            def blocks_of(n: int) -> int:
                return prompt_blocks(n, sizes)

            budget = extra.get("push_unclaimed_blocks")
            if budget is None:
                budget = default_budget(kv_cache_config.num_blocks, blocks_of(vllm_config.model_config.max_model_len))
            elif isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise ValueError(f"push_unclaimed_blocks must be a non-negative integer (KV blocks), got {budget!r}")
            # A charged hold ends at its lease at the latest (finished_sending);
            # past twice that, the charge is let go and logged.
            try:
                lease = float(extra.get("kv_lease_duration", 30))
            except (TypeError, ValueError):
                lease = 30.0  # the library refuses the value, naming it
            self._admission = PushAdmission(budget, blocks_of, hold_limit=2 * lease + 30)
        self._admission_logged = 0.0
        self._admission_warned = False
        self._arrived: list[str] = []
        # KV digests (kv_digest, shim/kvdigest.go). A pull prefill's
        # scheduler tracks each request for a remote decode until the step
        # that completes its prompt, whose metadata asks the workers to
        # digest its blocks after the forward; the digests come back in that
        # step's worker metadata and are added to the params
        # request_finished returned in the same update_from_output (vLLM
        # sends the outputs after it). On a worker: the step's digests, by
        # request id.
        # A bidirectional decode's scheduler does the same for the blocks it
        # holds for a read-back, one step after request_finished (its params
        # have left by then): the digests go to the library, whose side
        # channel serves them to the reader (shim/kvdigest_readback.go).
        self._kv_digest = str(extra.get("kv_digest", "fail"))
        self._digest_ok = (
            self._TRANSFER_MODE == "pull"
            and role == KVConnectorRole.SCHEDULER
            and ktc.kv_role != "kv_consumer"
            and self._kv_digest != "off"
        )
        self._readback_digest_ok = (
            self._TRANSFER_MODE == "pull"
            and role == KVConnectorRole.SCHEDULER
            and ktc.kv_role != "kv_producer"
            and bidirectional
            and self._kv_digest != "off"
        )
        if self._digest_ok or self._readback_digest_ok:
            from vllm.platforms import current_platform

            # Not digested (the decode reads unchecked, and says so): KV in
            # device memory (the hash kernel is not built), several pipeline
            # stages (a tp rank's digests would be one stage's), and a
            # speculative config (the draft model's KV layers are written
            # after get_transfer_results, where the digests are taken).
            why = ""
            if current_platform.device_type != "cpu" and not self._staging:
                why = "the KV cache is in device memory"
            elif vllm_config.parallel_config.pipeline_parallel_size > 1:
                why = "pipeline_parallel_size > 1"
            elif vllm_config.speculative_config is not None:
                why = "speculative decoding is configured"
            if why:
                self._digest_ok = self._readback_digest_ok = False
                logger.info("GoNixlConnector: no KV digests are taken on this engine (%s); its KV is read unchecked", why)
        self._digest_watch: dict[str, tuple["Request", list[list[int]]]] = {}
        self._digest_sent: dict[str, tuple[int, list[list[int]]]] = {}
        self._digest_waiting: dict[str, dict[str, Any]] = {}  # params of this step's finished requests
        self._digest_early: dict[str, dict[int, Any]] = {}  # digests that came before their request_finished
        self._digests: dict[str, dict[int, Any]] = {}
        # Read-back holds to digest in the next step, those asked for whose
        # digests have not all come (params, when asked), and the ranks'
        # digests come so far.
        self._readback_due: dict[str, tuple[int, list[list[int]], dict[str, Any]]] = {}
        self._readback_asked: dict[str, tuple[dict[str, Any], float]] = {}
        self._readback_got: dict[str, dict[int, Any]] = {}
        self._rank = 0  # the worker's tp rank, from register_kv_caches
        # The next step's metadata carries preemptions for the workers.
        self._fence_next = False
        self._kv_on_cuda = False
        # Calls skipped while they have nothing to do: the scheduler's
        # build_meta until a scheduler call changes its state (an idle step),
        # the worker's load errors and stats until get_finished says there
        # are some. True until the library has answered once. _sched_due:
        # when (time.monotonic) an idle scheduler's next timer is due
        # (idle_for), None for none.
        self._sched_dirty = True
        self._sched_due: Optional[float] = None
        self._load_errors_pending = True
        self._stats_pending = True
        # The worker's idle state (gonixl_worker_state), the change counter
        # seen by the last get_finished, and whether this step's metadata
        # asks for a poll.
        self._state: Optional[_lib.WorkerState] = None
        self._seq = -1
        self._poll_next = True
        mode = self._TRANSFER_MODE
        if role == KVConnectorRole.SCHEDULER:
            self._sched = Scheduler(
                _config_json(vllm_config, "scheduler", kv_cache_config, mode, kv_digest_readback=self._readback_digest_ok)
            )
        elif role == KVConnectorRole.WORKER:
            _request_amx_tile_permission()
            self._worker = Worker(_config_json(vllm_config, "worker", kv_cache_config, mode))
        else:
            raise ValueError(f"unsupported KVConnectorRole: {role}")
        logger.info("GoNixlConnector %s for engine %s (libgonixl %s)", role.name.lower(), self.engine_id, _lib.library_path())

    # ------------------------------------------------------------------
    # Class methods
    # ------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> Optional[str]:
        # Same as NixlConnector: heads before tokens inside a block, so that
        # one block of one layer is a contiguous range.
        if vllm_config.model_config is None or vllm_config.model_config.use_mla:
            return None
        return "LBHNC"

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Optional[KVConnectorStats]:
        return NixlKVConnectorStats(data=data) if data is not None else NixlKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return NixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------
    def get_finished_count(self) -> Optional[int]:
        return None

    def _check_prompt_digest(self, request: "Request") -> None:
        """Drop remote-prefill parameters whose prompt digest does not match
        this request's prompt: the prompt is then computed locally, and the
        prefill named in them is neither read from nor notified (its blocks
        may belong to another live request; they are freed at its lease)."""
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill") or PROMPT_DIGEST_KEY not in p:
            return
        want = p.get(PROMPT_DIGEST_KEY)
        n = p.get("remote_num_tokens")
        got = prompt_digest(request.prompt_token_ids, n) if isinstance(n, int) else None
        if got is not None and got == want:
            # Checked once: a waiting request is asked about on every
            # scheduling step, and its prompt does not change.
            del p[PROMPT_DIGEST_KEY]
            return
        if getattr(request, "abort_immediately", False):
            # vLLM's stand-in for a request its server rejected before the
            # engine saw it (notify_kv_transfer_request_rejected: prompt [0],
            # aborted at once): nothing is read, and with no prompt to check
            # the parameters against, the prefill is not notified either; it
            # frees those blocks at its lease.
            logger.info(
                "GoNixlConnector: request %s was rejected before it reached the engine; the blocks of engine %s "
                "(request %s) are freed at that prefill's lease",
                request.request_id,
                p.get("remote_engine_id"),
                p.get("remote_request_id"),
            )
        else:
            logger.error(
                "GoNixlConnector: request %s: kv_transfer_params from engine %s (request %s) hold the KV of another prompt "
                "(prompt digest mismatch over %s tokens); computing the prompt locally",
                request.request_id,
                p.get("remote_engine_id"),
                p.get("remote_request_id"),
                n,
            )
        request.kv_transfer_params = {k: v for k, v in p.items() if not k.startswith("remote_") and k != PROMPT_DIGEST_KEY}
        request.kv_transfer_params["do_remote_prefill"] = False
        request.kv_transfer_params["gonixl_prompt_mismatch"] = True

    def _check_readback_digest(self, request: "Request") -> None:
        """Bidirectional turn: limit the pull from the decode to the leading
        prompt tokens that are the decode's tokens (gonixl.digest). An
        edited history then pulls the unchanged prefix, or nothing."""
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_decode") or p.get("_remote_blocks_processed"):
            return
        if READBACK_DIGEST_KEY not in p:
            if p.get(EXPIRY_UNIX_KEY) is not None and p.get("remote_block_ids") and READBACK_TOKENS_KEY not in p:
                # A gonixl decode's params (only gonixl sends its expiry)
                # without the digest it always adds when it can: what its
                # blocks hold is not known. Pull nothing.
                logger.warning(
                    "GoNixlConnector: request %s: kv_transfer_params from gonixl decode engine %s carry no token digest; "
                    "pulling nothing (the prompt is computed here)",
                    request.request_id,
                    p.get("remote_engine_id"),
                )
                p[READBACK_TOKENS_KEY] = 0
                return
            if p.get("remote_block_ids") and READBACK_TOKENS_KEY not in p:
                # A stock NixlConnector decode advertises num_computed_tokens,
                # which with async scheduling (vLLM's default on GPUs) counts
                # a step still in flight: the last sampled token, whose KV
                # belongs to that token (a stop token the next prompt does not
                # have at that position). Its last advertised token is never
                # pulled; without async scheduling that costs one token.
                rn = p.get("remote_num_tokens")
                p[READBACK_TOKENS_KEY] = max(0, rn - 1) if isinstance(rn, int) else 0
                if not self._warned_no_digest:
                    self._warned_no_digest = True
                    logger.warning(
                        "GoNixlConnector: kv_transfer_params from decode engine %s carry no token digest (a stock "
                        "NixlConnector decode): the conversation history is not checked against the decode's tokens "
                        "before its KV is pulled, and its last advertised token (in flight under async scheduling) is "
                        "computed here",
                        p.get("remote_engine_id"),
                    )
            return
        digest = p.pop(READBACK_DIGEST_KEY)
        rn = p.get("remote_num_tokens")
        n = rn if isinstance(rn, int) else 0
        try:
            matched = matched_tokens(digest, request.prompt_token_ids or ())
        except DigestError as e:
            logger.error(
                "GoNixlConnector: request %s: %s; pulling nothing from decode engine %s",
                request.request_id,
                e,
                p.get("remote_engine_id"),
            )
            matched = 0
        p[READBACK_TOKENS_KEY] = matched
        if matched < min(n, len(request.prompt_token_ids or ())):
            logger.warning(
                "GoNixlConnector: request %s: the prompt differs from the tokens whose KV decode engine %s holds "
                "(request %s, %s tokens) after token %s: pulling %s",
                request.request_id,
                p.get("remote_engine_id"),
                p.get("remote_request_id"),
                n,
                matched,
                f"the first {matched} tokens" if matched else "nothing (the prompt is computed here)",
            )

    def on_new_request(self, request: "Request") -> None:
        self._check_prompt_digest(request)
        self._check_readback_digest(request)
        pj = _params_json(request)
        if not pj:
            return
        self._sched_dirty = True
        self._per_request(request, self._scheduler().on_new_request, request.request_id, pj)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        adm = self._admission
        if adm is not None and (request.kv_transfer_params or {}).get("do_remote_decode"):
            n = len(request.prompt_token_ids or ())
            if not adm.admit(request.request_id, get_base_request_id(request.request_id), n):
                # Not yet: it waits in vLLM's queue, holding nothing, until
                # its decode registers or the unclaimed holds drain.
                self._log_admission()
                return None, False
        self._check_prompt_digest(request)
        self._check_readback_digest(request)
        params = request.kv_transfer_params
        if params and not self._bidirectional and not params.get("do_remote_prefill"):
            # Nothing can load: only a decode's remote prefill and a
            # bidirectional read-back do (the library answers (0, False) for
            # everything else, a prefill's own requests included), and a 0
            # where KV could load would only compute the prompt here. No
            # call: a prefill's requests cross only for request_finished.
            return 0, False
        pj = _params_json(request)
        if not pj:
            return 0, False
        self._sched_dirty = True
        got = self._per_request(
            request, self._scheduler().get_num_new_matched_tokens, pj, len(request.prompt_token_ids or ()), num_computed_tokens
        )
        return got if got is not None else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        pj = _params_json(request)
        if not pj:
            return
        params = request.kv_transfer_params or {}
        if (
            self._push_early_ok
            and params.get("do_remote_decode")
            and getattr(request, "max_tokens", None) == 1
            and request.request_id not in self._push_early_seen
        ):
            self._push_early_seen.add(request.request_id)
            self._push_early[request.request_id] = (request, [])
        if self._digest_ok and params.get("do_remote_decode") and request.request_id not in self._digest_watch:
            # Watched afresh (also after a preemption): digests of an earlier
            # computation of this prompt would not match its KV now.
            self._digest_watch[request.request_id] = (request, [])
            self._digest_sent.pop(request.request_id, None)
            self._digest_early.pop(request.request_id, None)
        push_register = self._TRANSFER_MODE == "push" and num_external_tokens > 0 and bool(params.get("do_remote_prefill"))
        if push_register:
            # The registration carries this prompt's digest: the prefill
            # WRITEs only if it holds the KV of the same tokens.
            pj = _with_digest(params, request.prompt_token_ids, len(request.prompt_token_ids or ())) or pj
        groups: tuple = ()
        if num_external_tokens > 0:
            groups = tuple(self.kv_cache_config.select_transfer_block_ids(blocks.get_unhashed_block_ids_all_groups()))
        # Blocks of the local prefix-cache hit, per transfer group (the Go
        # side checks the remote block list against cached + new blocks).
        # select_transfer_block_ids picks one entry per transfer group,
        # whatever the entries are: vLLM annotates them as block-id lists,
        # here they are counts.
        counts: Any = [sum(b.block_hash is not None and not b.is_null for b in g) for g in blocks.blocks]
        computed = cast("tuple[int, ...]", self.kv_cache_config.select_transfer_block_ids(counts))
        if self._staging:
            if request.kv_transfer_params and request.kv_transfer_params.get("do_remote_decode"):
                self._need_save[request.request_id] = request
            elif groups:
                self._stage_recv[request.request_id] = [b for g in groups for b in g]
        if self._admission is not None and params.get("do_remote_decode"):
            within = self._admission.allocated(
                request.request_id, get_base_request_id(request.request_id), len(request.prompt_token_ids or ())
            )
            if not within and not self._admission_warned:
                self._admission_warned = True
                logger.warning(
                    "GoNixlPushConnector: request %s was scheduled past push_unclaimed_blocks without the connector "
                    "being asked (vLLM does so for requests that skip the prefix cache, e.g. with prompt_logprobs); "
                    "such requests are not held back (logged once)",
                    request.request_id,
                )
        self._sched_dirty = True

        def taken(mutated: bool) -> None:
            if mutated and request.kv_transfer_params is not None:  # never None: pj came from it
                # Mirror vLLM: the request's params now say the remote
                # blocks were taken care of.
                request.kv_transfer_params["do_remote_prefill"] = False
                request.kv_transfer_params["_remote_blocks_processed"] = True
                if push_register:
                    self._push_registered.add(request.request_id)

        if push_register:
            # For the worker with this step's metadata (has_pending_push_work).
            self._push_registering.add(request.request_id)
        # Queued for this step's build_meta (vLLM calls it after the
        # step's allocations, before anything reads these params again):
        # no crossing of its own.
        self._scheduler().update_state_after_alloc_later(request.request_id, pj, groups, computed, num_external_tokens, taken)

    def _transfer_ids(self, block_ids: Any) -> Any:
        """A request's block ids per vLLM KV-cache group, reduced to the
        transfer groups (a list already per transfer group is kept)."""
        if len(block_ids) == len(self.kv_cache_config.kv_cache_groups):
            return self.kv_cache_config.select_transfer_block_ids(block_ids)
        return block_ids

    @staticmethod
    def _prompts_done(
        watch: dict[str, tuple["Request", list[list[int]]]], scheduler_output: "SchedulerOutput"
    ) -> list[tuple["Request", list[list[int]]]]:
        """The watched requests whose prompt this step completes, with all
        their blocks per KV-cache group (tracked from vLLM's per-step block
        lists, as its _build_save_meta does); they leave watch."""
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        done = []
        scheduled_tokens = scheduler_output.num_scheduled_tokens or {}
        for req_id, new_groups, resumed in yield_req_data(scheduler_output):
            entry = watch.get(req_id)
            if entry is None:
                continue
            req, acc = entry
            if new_groups is not None:
                if resumed or not acc:
                    acc[:] = [list(g) for g in new_groups]
                else:
                    for g, new in zip(acc, new_groups, strict=True):
                        g.extend(new)
            if req.num_computed_tokens + scheduled_tokens.get(req_id, 0) < req.num_prompt_tokens:
                continue
            del watch[req_id]
            done.append(entry)
        return done

    def _digest_prompts_done(self, scheduler_output: "SchedulerOutput") -> list[dict[str, Any]]:
        """Pull mode, a prefill: the requests whose prompt this step
        completes, for the workers to digest after the forward. A block id
        listed twice (a sliding-window block freed and given back to the
        same prompt) counts at its last position."""
        out = []
        for req, acc in self._prompts_done(self._digest_watch, scheduler_output):
            groups = _last_places(self._transfer_ids(tuple(acc)))
            self._digest_sent[req.request_id] = (req.num_prompt_tokens, groups)
            out.append({"id": req.request_id, "tokens": req.num_prompt_tokens, "blocks": groups})
        return out

    def _readback_holds(self) -> list[dict[str, Any]]:
        """A bidirectional decode: the blocks request_finished held for a
        read-back since the last step, for the workers to digest after this
        step's forward (the step that made them final is done)."""
        out = []
        now = time.monotonic()
        for rid, (tokens, groups, params) in self._readback_due.items():
            self._digest_sent[rid] = (tokens, groups)
            self._readback_asked[rid] = (params, now)
            out.append({"id": rid, "tokens": tokens, "blocks": groups, "held": True})
        self._readback_due.clear()
        return out

    def _push_prompts_done(self, scheduler_output: "SchedulerOutput") -> bool:
        """Push mode, a prefill: announces the requests whose prompt this
        step completes, with all their blocks. True if any was."""
        announced = False
        for req, acc in self._prompts_done(self._push_early, scheduler_output):
            req_id = req.request_id
            params = req.kv_transfer_params or {}
            pj = _with_digest(params, req.prompt_token_ids, req.num_prompt_tokens)
            if pj is None:
                pj = _encode_params(params)
            done = self._per_request(
                req, self._scheduler().push_prompt_done, req_id, pj, self._transfer_ids(tuple(acc)), req.num_prompt_tokens
            )
            if done is not None:
                self._sched_dirty = True
                announced = True
        return announced

    def _push_preempted(self, scheduler_output: "SchedulerOutput") -> None:
        """Push mode, a prefill: tells the library which tracked requests
        vLLM preempted this step; it fences their early WRITEs before the
        step's forward can overwrite the blocks."""
        preempted = scheduler_output.preempted_req_ids
        if not preempted:
            return
        ids = preempted & self._push_early_seen
        if ids:
            self._sched_dirty = True
            self._fence_next = True
            self._scheduler().push_preempted(sorted(ids))

    def has_pending_block_frees(self) -> bool:
        """vLLM asks before it preempts a request to make room: while a
        prompt announced for an early WRITE is not finished, the WRITE may
        read its blocks, and vLLM waits a step instead (push mode)."""
        if not self._push_early_seen or self._sched is None or not self._sched.handle:
            return False
        pending, fenced = self._sched.pending_block_frees()
        if fenced:
            self._sched_dirty = True
            self._fence_next = True
        return pending

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._admission is not None:
            self._admission.new_pass()
        if self._push_early_seen:
            self._push_preempted(scheduler_output)
        push_early = bool(self._push_early) and self._push_prompts_done(scheduler_output)
        if self._digest_waiting:
            # The last step's update_connector_output never came: read unchecked.
            self._take_digests(None)
        if self._digest_sent or self._digest_watch:
            for rid in scheduler_output.preempted_req_ids or ():
                # Freed and recomputed later: its digests (taken or asked
                # for) are of KV that is gone.
                self._digest_watch.pop(rid, None)
                self._digest_sent.pop(rid, None)
                self._digest_early.pop(rid, None)
        digest = self._digest_prompts_done(scheduler_output) if self._digest_watch else None
        if self._readback_due:
            digest = (digest or []) + self._readback_holds()
        if self._sched_dirty or (self._sched_due is not None and time.monotonic() >= self._sched_due):
            # The library answers b"" for an idle step (no work, no timer
            # due), which stays idle until one of the calls that set
            # _sched_dirty, or until the timer idle_for() names (a decode's
            # next heartbeat to the prefills holding its blocks): until
            # then no call is made (an idle engine step costs no call into
            # the library; the worker skips its own).
            sched = self._scheduler()
            data = sched.build_meta()
            self._sched_dirty = bool(data)
            self._sched_due = None
            if not data:
                wait = sched.idle_for()
                if wait >= 0:
                    self._sched_due = time.monotonic() + wait
        else:
            data = b""
        self._push_registering.clear()  # handed to the worker with this step
        preempted, self._fence_next = self._fence_next and bool(data), False
        if not self._staging:
            return GoNixlConnectorMetadata(data, push_early=push_early, preempted=preempted, digest=digest)
        save = self._staging_saves(scheduler_output)
        recv, self._stage_recv = self._stage_recv, {}
        return GoNixlConnectorMetadata(data, save=save, recv=recv, preempted=preempted, digest=digest)

    def _staging_saves(self, scheduler_output: "SchedulerOutput") -> dict[str, list[int]]:
        """Host staging, a prefill for a remote decode: the blocks each step
        writes, to copy into the host mirror after its forward, until the
        prompt is done. A step writes into its new blocks and, when the last
        chunk ended inside a block, into that block too — which is not new
        (vLLM's new_block_ids; a chunk that fits in it has none): each
        group's last block so far is saved again, or the mirror keeps that
        block's tail from before the chunk and a decode reads stale KV."""
        from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

        save: dict[str, list[int]] = {}
        scheduled_tokens = scheduler_output.num_scheduled_tokens or {}
        for rid in scheduler_output.preempted_req_ids or ():
            self._save_tails.pop(rid, None)  # its blocks were freed: maybe another request's now
        # A request scheduled as new has all its blocks listed: a fresh one,
        # or one resumed after a preemption (vLLM's V2 model runner lists
        # those among the new ones, with resumed False), whose old last
        # block may belong to another request by now.
        fresh = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        for req_id, new_groups, resumed in yield_req_data(scheduler_output):
            req = self._need_save.get(req_id)
            if req is None:
                continue
            tails = [] if resumed or req_id in fresh else self._save_tails.get(req_id, [])
            blocks = [b for b in tails if b >= 0]
            if new_groups is not None:
                blocks += [b for g in new_groups for b in g]
                last = [g[-1] if g else (tails[i] if i < len(tails) else -1) for i, g in enumerate(new_groups)]
                self._save_tails[req_id] = last
            if blocks:
                save[req_id] = list(dict.fromkeys(blocks))
            if req.num_computed_tokens + scheduled_tokens.get(req_id, 0) >= req.num_prompt_tokens:
                del self._need_save[req_id]
                self._save_tails.pop(req_id, None)
        return save

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        if self._readback_asked:
            self._serve_digests(getattr(connector_output, "kv_connector_worker_meta", None))
        if self._digest_sent:
            self._take_digests(getattr(connector_output, "kv_connector_worker_meta", None))
        adm = self._admission
        if adm is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, GoNixlWorkerMeta) and meta.push_arrivals:
                adm.claimed(meta.push_arrivals)
            if connector_output.finished_sending:
                adm.hold_ended(connector_output.finished_sending)
            adm.tick()
            if adm.expired:
                logger.warning(
                    "GoNixlPushConnector: the push admission let go of %d requests' charges whose hold outlived twice "
                    "kv_lease_duration without finished_sending: %s",
                    len(adm.expired),
                    adm.expired[:8],
                )
                adm.expired.clear()
        if self._push_sending and connector_output.finished_sending:
            self._push_sending -= connector_output.finished_sending
        done = connector_output.finished_recving
        if done:
            if self._push_registered or self._push_unreceived:
                self._push_registered -= done
                for rid in done:
                    self._push_unreceived.pop(rid, None)
            self._sched_dirty = True
            self._scheduler().update_connector_output(done)

    def _take_digests(self, meta: Any) -> None:
        """The step's digests (workers' metadata) go into the params of the
        requests request_finished returned in this update_from_output; a
        digest that comes first waits for its request_finished. A request
        whose digests did not come in its finishing step is read unchecked."""
        if isinstance(meta, GoNixlWorkerMeta):
            for rid, ranks in meta.digests.items():
                if rid in self._readback_asked:
                    continue  # a read-back's, whose other ranks are to come (_serve_digests)
                params = self._digest_waiting.pop(rid, None)
                if params is not None:
                    self._attach_digest(rid, params, ranks)
                elif rid in self._digest_sent:
                    self._digest_early[rid] = ranks
        for rid in self._digest_waiting:
            self._digest_sent.pop(rid, None)
        self._digest_waiting.clear()

    def _serve_digests(self, meta: Any) -> None:
        """A bidirectional decode: the workers' digests of held blocks go to
        the library, which serves them to the reader; a hold whose digests
        did not come within _READBACK_DIGEST_WAIT seconds of the step that
        asked is served as not digested (its reader stops waiting)."""
        served: dict[str, Any] = {}
        if isinstance(meta, GoNixlWorkerMeta):
            for rid, ranks in meta.digests.items():
                asked = self._readback_asked.get(rid)
                if asked is None:
                    continue
                # Each rank hashes on its own goroutine: their digests may
                # come in different steps.
                got = self._readback_got.setdefault(rid, {})
                got.update(ranks)
                if len(got) < int(asked[0].get("tp_size") or 1):
                    continue
                del self._readback_asked[rid], self._readback_got[rid]
                if any(d is None for d in got.values()):
                    # A rank's hold ended before it could hash (its reader
                    # was quicker than the step that asked): read unchecked.
                    self._digest_sent.pop(rid, None)
                    served[rid] = None
                    continue
                params = {k: asked[0].get(k) for k in ("remote_block_ids", "tp_size")}
                self._attach_digest(rid, params, got)
                served[rid] = params.get(KV_DIGEST_KEY)
        now = time.monotonic()
        for rid in [r for r, (_, t) in self._readback_asked.items() if now - t > _READBACK_DIGEST_WAIT]:
            del self._readback_asked[rid]
            self._readback_got.pop(rid, None)
            self._digest_sent.pop(rid, None)
            served[rid] = None
        if served:
            try:
                self._scheduler().kv_digests(served)
            except Exception as e:  # a read-back goes unchecked, never the engine down
                logger.warning(
                    "GoNixlConnector: serving KV digests failed (%s); read-backs of %d requests go unchecked", e, len(served)
                )

    def _attach_digest(self, rid: str, params: dict[str, Any], ranks: dict[int, Any]) -> None:
        """Adds gonixl_kv_digest to a finished request's params: each rank's
        digests of the blocks the params name, in their order
        (shim/kvwire/kvdigest.go)."""
        sent = self._digest_sent.pop(rid, None)
        if sent is None:  # a request id seen twice (vLLM's randomisation off)
            return
        tokens, blocks = sent
        tp = int(params.get("tp_size") or 1)
        adv = params.get("remote_block_ids") or []
        why = ""
        if sorted(ranks) != list(range(tp)) or len(adv) != len(blocks):
            why = f"digests of ranks {sorted(ranks)} for tp_size {tp}, {len(blocks)} groups for {len(adv)}"
        first: list[int] = []
        whole: list[bool] = []
        place: list[Optional[list[Optional[int]]]] = []
        for g, ids in enumerate(adv if not why else ()):
            got = _digest_places(ids, blocks[g])
            if got is None:
                why = f"group {g}: the params' blocks {list(ids)[:12]} are not a run of the prompt's {blocks[g][:40]}"
                break
            first.append(got[0])
            place.append(got[1])
            whole.append(got[2])
        if why:
            if not self._warned_digest:
                self._warned_digest = True
                logger.warning("GoNixlConnector: request %s goes without KV digests (%s); logged once", rid, why)
            return
        out = []
        for r in range(tp):
            d = ranks[r]
            out.append(
                {
                    "blocks": [_pack_u64(_placed(d["blocks"][g], place[g], len(adv[g]))) for g in range(len(adv))],
                    "regions": [_pack_u64(d["regions"][g]) if whole[g] else "" for g in range(len(adv))],
                }
            )
        params[KV_DIGEST_KEY] = {"alg": "xxh3-64", "tokens": tokens, "first": first, "ranks": out}

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        self._need_save.pop(request.request_id, None)
        self._save_tails.pop(request.request_id, None)
        self._digest_watch.pop(request.request_id, None)
        self._push_early.pop(request.request_id, None)
        self._push_early_seen.discard(request.request_id)
        if request.request_id in self._push_registered:
            self._push_registered.discard(request.request_id)
            self._push_unreceived[request.request_id] = time.monotonic()
        pj = _params_json(request)
        if not pj:
            return False, None
        from vllm.v1.request import RequestStatus

        # A request announced for an early WRITE is a push send whatever
        # its status (an abort after the forward leaves whole KV a WRITE may
        # be reading): the library knows which and overrides "normal".
        normal = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        # Tokens whose KV is written: with async scheduling a step that is
        # still in flight counts in num_computed_tokens already (vLLM
        # subtracts num_in_flight_tokens where it needs the same), and with
        # speculative decoding the count may run past the token ids.
        in_flight = getattr(request, "num_in_flight_tokens", 0)
        computed = max(0, min(request.num_computed_tokens - in_flight, len(request.all_token_ids)))
        push_prefill = self._TRANSFER_MODE == "push" and bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        transfer_ids = self._transfer_ids(block_ids)
        if push_prefill:
            # The decode registered blocks for its prompt: a request that
            # ran past its prompt (max_tokens > 1) WRITEs the prompt's
            # blocks only, with the prompt's digest (the decode writes
            # nowhere else, and refuses a registration match without one).
            n_prompt = request.num_prompt_tokens
            if computed > n_prompt:
                computed = n_prompt
                transfer_ids = tuple(
                    list(g)[: -(-n_prompt // gs["block_size"])] for g, gs in zip(transfer_ids, self._groups, strict=True)
                )
            # Its WRITE goes only to a decode whose prompt has this digest.
            pj = _with_digest(request.kv_transfer_params or {}, request.prompt_token_ids, computed) or pj
        self._sched_dirty = True
        sched = self._scheduler()
        if not self._bidirectional and not (request.kv_transfer_params or {}).get("do_remote_decode"):
            # A decode's (without bidirectional transfer): the answer holds
            # nothing, always; what the library does with it (heartbeats
            # stopped, a prefill not read from told to free) goes with the
            # next step's build_meta — vLLM steps once more after a finish.
            sched.request_finished_later(request.request_id, pj, transfer_ids, normal, computed)
            if request.kv_transfer_params is not None and request.kv_transfer_params.get("do_remote_prefill"):
                request.kv_transfer_params["do_remote_prefill"] = False
            return False, None
        sched.flush()  # the queued calls of other requests: their errors are not this request's
        got = self._per_request(request, sched.request_finished, request.request_id, pj, transfer_ids, normal, computed)
        if got is None:
            if self._admission is not None:
                self._admission.finished(request.request_id, False)
            return False, None
        delay, params = got
        if request.kv_transfer_params is not None and request.kv_transfer_params.get("do_remote_prefill"):
            request.kv_transfer_params["do_remote_prefill"] = False
        if push_prefill and delay:
            self._push_sending.add(request.request_id)
        if self._admission is not None:
            self._admission.finished(request.request_id, bool(push_prefill and delay))
        rid = request.request_id
        if rid in self._digest_sent:
            ranks = self._digest_early.pop(rid, None)
            if not (params and params.get("do_remote_prefill") and delay):
                self._digest_sent.pop(rid, None)
            elif ranks is not None:
                self._attach_digest(rid, params, ranks)
            else:
                self._digest_waiting[rid] = params  # the step's worker metadata comes next
        if params and params.get("do_remote_prefill"):
            digest = prompt_digest(request.prompt_token_ids, params.get("remote_num_tokens") or 0)
            if digest is not None:
                params[PROMPT_DIGEST_KEY] = digest
        elif params and params.get("do_remote_decode") and params.get("remote_block_ids"):
            # A decode's params for the next turn (bidirectional): what its
            # blocks hold, for the prefill to check its prompt against.
            n = params.get("remote_num_tokens") or 0
            tdigest = token_digest(request.all_token_ids, n, self._block_size)
            if tdigest is not None:
                params[READBACK_DIGEST_KEY] = tdigest
            if delay and params.get(KV_DIGEST_SERVED_KEY):
                # Digested by the workers in the next step (their KV is
                # final: the step that wrote the last advertised token is
                # done by then), served by the library's side channel.
                self._readback_due[rid] = (n, _last_places(transfer_ids), params)
        return delay, params

    def has_pending_push_work(self) -> bool:
        """Push mode: keeps vLLM's engine stepping while a prefill request's
        blocks wait for their WRITE, a registration for the worker, or (for
        a while) a finished decode request for its finished_recving."""
        if self._push_sending or self._push_registering:
            return True
        if self._push_unreceived:
            horizon = time.monotonic() - _PUSH_HOLD_STEPPING
            for rid in [r for r, t in self._push_unreceived.items() if t < horizon]:
                del self._push_unreceived[rid]
            return bool(self._push_unreceived)
        return False

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        for (pp, tp), m in sorted(metadata.items()):
            if not isinstance(m, GoNixlHandshakeMetadata):
                raise ValueError(f"GoNixlConnector expects GoNixlHandshakeMetadata, got {type(m).__name__}")
            self._sched_dirty = True
            self._scheduler().set_handshake_payload(pp, tp, m.payload)

    def _scheduler(self) -> Scheduler:
        assert self._sched is not None, "a scheduler-side call on a worker connector"
        return self._sched

    def _work(self) -> Worker:
        assert self._worker is not None, "a worker-side call on a scheduler connector"
        return self._worker

    @staticmethod
    def _per_request(request: "Request", fn: Callable[..., _T], *args: Any) -> Optional[_T]:
        """A scheduler call about one request: bad kv_transfer_params fail
        that request's transfer with a log line (None), never the engine."""
        try:
            return fn(*args)
        except errors.InvalidArgumentError as e:
            logger.error("GoNixlConnector: request %s: invalid kv_transfer_params, no KV transfer: %s", request.request_id, e)
            return None

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        # Every layer goes to the library with its KV-cache group and kind;
        # the library puts the regions in vLLM's NixlConnector order (model
        # layer order, shared tensors once) and skips layers without a spec.
        specs = _layer_specs(self.kv_cache_config)
        backends = get_current_attn_backends(self._vllm_config)
        backend = backends[0].get_name() if backends else ""
        layout = self._vllm_config.cache_config.get_resolved_kv_cache_layout()
        # Blocks read from a prefill of a smaller block size are put in this
        # engine's token order on the device caches (after host staging's
        # copy, if any).
        kind, kernel = _block_kind(self._vllm_config, backend, layout)
        self._reshaper = BlockReshaper(
            kv_caches,
            self.kv_cache_config.num_blocks,
            self._vllm_config.cache_config.block_size,
            self._vllm_config.model_config.get_head_size(),
            kind,
            skip={n for n in kv_caches if n not in specs},
        )
        if self._staging:
            # The engine registers and moves pinned host mirrors.
            self._host = HostStaging(kv_caches, self.kv_cache_config.num_blocks)
            kv_caches = self._host.host_caches
        layers = layer_descriptions(kv_caches, specs)
        self._kv_on_cuda = any(t.is_cuda for t in kv_caches.values())
        payload = self._work().register_kv_caches(
            layers,
            self.kv_cache_config.num_blocks,
            self._vllm_config.cache_config.block_size,
            attn_backend=backend,
            kv_cache_layout=layout.name,
            block_reshape=self._reshaper.mode,
            kernel_layout=kernel,
            head_size=self._vllm_config.model_config.get_head_size(),
        )
        self._rank = _tp_rank("worker")
        self._handshake = GoNixlHandshakeMetadata(payload)
        # From here on get_finished is skipped in idle steps (the state is
        # the library's, read without a call).
        self._state = self._work().state()

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return self._handshake

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls this before the step's forward: WRITEs of announced
        prompts vLLM preempted are dropped or waited for before the forward
        can give their blocks another request's KV (push mode)."""
        meta = kv_connector_metadata
        if isinstance(meta, GoNixlConnectorMetadata) and meta.preempted and meta.data:
            self._work().handle_preemptions(meta.data)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, GoNixlConnectorMetadata)
        if self._host is not None:
            self._recv_blocks.update(meta.recv)
        if meta.data:  # b"": an idle step (build_connector_meta)
            # A step with metadata may start work: its get_finished polls.
            self._poll_next = True
            if self._sync_before_load and self._kv_on_cuda:
                torch.cuda.synchronize()
            self._work().start_load_kv(meta.data)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        pass

    def wait_for_save(self):
        if self._host is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, GoNixlConnectorMetadata)
        blocks = [b for ids in meta.save.values() for b in ids]
        if blocks:
            # After this step's forward, before its outputs (and so the
            # prefill's response) leave: no decode can read them earlier.
            self._host.save_to_host(blocks)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        if isinstance(meta, GoNixlConnectorMetadata) and meta.digest:
            # After the forward that completed these prompts (and host
            # staging's save, which waits for its copies): their KV is final.
            # A prefill's are digested here, before the step's outputs, and
            # so the params, leave; a decode's read-back holds on a
            # goroutine (their digests are served later; the holds'
            # finished_sending waits for the hashing).
            prompts = [d for d in meta.digest if not d.get("held")]
            held = [d for d in meta.digest if d.get("held")]
            if held:
                try:
                    self._work().kv_digest_held(held)
                except errors.GoNixlError as e:
                    # Served as not digested at once (the reader stops waiting).
                    self._digest_failed(e)
                    self._add_digests({d["id"]: None for d in held})
            if prompts:
                try:
                    self._add_digests(self._work().kv_digest(prompts))
                except errors.GoNixlError as e:
                    self._digest_failed(e)
        if self._kv_on_cuda:
            meta = self._connector_metadata
            if isinstance(meta, GoNixlConnectorMetadata) and meta.push_early:
                # The library WRITEs this step's completed prompts now: the
                # forward's kernels that fill their blocks must be done.
                torch.cuda.synchronize()
        st = self._state
        if st is not None:
            # An idle step (shim/idle.go): nothing in flight or held, nothing
            # changed off this thread, no metadata this step: nothing for
            # the library to find, and no call.
            seq = st.seq
            if not self._poll_next and not st.busy and seq == self._seq:
                return KVConnectorTransferResults(finished_sending=set(), finished_recving=set(), failed_recving=set())
            self._seq, self._poll_next = seq, False
        r = self._work().get_finished()
        # Whether the next two per-step calls have anything to return.
        self._load_errors_pending = r.load_errors_pending
        self._stats_pending = r.stats_pending
        if r.push_arrivals_pending:
            self._arrived.extend(self._work().push_arrivals())
        if r.digests_pending:
            self._add_digests(self._work().kv_digests_ready())
        if self._host is not None:
            for req in r.failed_recving:
                self._recv_blocks.pop(req, None)
            for req in r.finished_recving:
                blocks = self._recv_blocks.pop(req, None)
                if blocks:
                    self._host.load_to_device(blocks)  # before vLLM computes from them
        for entries in r.reshape.values():
            # Read from a prefill of a smaller block size: in token order
            # before vLLM computes from them.
            self._reshaper.apply(entries)
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending, finished_recving=r.finished_recving, failed_recving=r.failed_recving
        )

    def _digest_failed(self, e: Exception) -> None:
        """Never vLLM's forward's failure: the requests go unchecked."""
        if not self._warned_digest:
            self._warned_digest = True
            logger.warning("GoNixlConnector: KV digests failed (%s); these requests are read unchecked (logged once)", e)

    def _add_digests(self, got: dict[str, Any]) -> None:
        """This rank's digests, by request id, for the step's worker
        metadata."""
        rank = self._rank
        for rid, d in got.items():
            self._digests[rid] = {rank: d}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending, r.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._load_errors_pending:
            return set()
        blocks = set(self._work().load_errors())
        if len(self.kv_cache_config.kv_cache_groups) > 1:
            # Block ids are unique only within a group: vLLM's scheduler
            # refuses invalid_block_ids for such layouts (RuntimeError in
            # _handle_invalid_blocks). The same failures are reported per
            # request in failed_recving (get_transfer_results).
            return set()
        return blocks

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        """A prefill: the push registrations that arrived, for the
        scheduler's admission (push_admission.py), and the step's KV
        digests."""
        if not self._arrived and not self._digests:
            return None
        meta = GoNixlWorkerMeta(frozenset(self._arrived), self._digests)
        self._arrived, self._digests = [], {}
        return meta

    def _log_admission(self) -> None:
        adm = self._admission
        now = time.monotonic()
        if adm is None or now - self._admission_logged < 10.0:
            return
        self._admission_logged = now
        logger.info(
            "GoNixlPushConnector: %d prefill requests wait for their decodes to register: %d blocks computed or "
            "being computed for decodes that have not registered, budget %d (push_unclaimed_blocks)",
            len(adm.deferred),
            adm.charged_blocks,
            adm.budget,
        )

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        if self._worker is None or not self._worker.handle or not self._stats_pending:
            return None
        self._stats_pending = False
        data = self._worker.stats()
        return NixlKVConnectorStats(data=data) if data else None

    def metrics_text(self) -> str:
        """gonixl's own Prometheus registry (worker side), text format."""
        return self._work().metrics_text()

    def live_counts(self) -> dict[str, int]:
        """What this connector's engines hold right now (transfer handles,
        held leases, pending handshakes, ...): all zero at rest but
        remote_engines and panics. For leak checks; also served as gauges
        with GONIXL_METRICS_PORT (docs/ENVIRONMENT.md)."""
        out: dict[str, int] = {}
        if self._worker is not None and self._worker.handle:
            out.update(self._worker.live())
        if self._sched is not None and self._sched.handle:
            out.update(self._sched.live())
        return out

    def shutdown(self):
        # The objects stay, their handles closed: a later call is the
        # library's InvalidHandleError, never a crash.
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()


class GoNixlPushConnector(GoNixlConnector):
    """vLLM KV connector in push mode (as NixlPushConnector): the decode
    registers its blocks with the prefill, which WRITEs its KV into them.
    Same configuration keys; push_registration_timeout (seconds, default
    decoder_kv_blocks_ttl) bounds a decode request's wait for the WRITE."""

    _TRANSFER_MODE = "push"

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config or {}) if ktc is not None else {}
        if _extra_bool(extra.get("bidirectional_kv_xfer")):
            raise NotImplementedError("Bidirectional KV transfer is not supported for NIXL push connector.")
        super().__init__(vllm_config, role, kv_cache_config)
