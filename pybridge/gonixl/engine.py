"""gonixl's engine without vLLM: the scheduler and worker handles of the
library with plain Python arguments.

:mod:`gonixl.vllm` adapts vLLM's connector interface onto these calls; this
module is for everything that drives the engine without vLLM (tests, the GPU
data-path test on machines where vLLM is not installed, tools). The
arguments are those vLLM passes, flattened: request ids, kv_transfer_params
dicts, per-KV-cache-group block id lists, and KV-cache tensors (any object
with torch.Tensor's data_ptr / untyped_storage / shape / stride / device
attributes).

A process uses one library, loaded on the first call (never at import:
vLLM forks, and a Go runtime does not survive fork).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import struct
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

from . import _lib

try:
    # The library's JSON answers on per-request paths (request_finished's
    # params, a prefill worker's KV digests), decoded in a fifth of
    # json.loads's time (1.1 against 4.9 µs for a 32-block pull's params).
    # vLLM depends on msgspec; without it, the standard library.
    from msgspec.json import Decoder as _Decoder

    _loads: Callable[[bytes], Any] = _Decoder().decode
except ImportError:  # pragma: no cover - vLLM always brings msgspec
    _loads = json.loads


def flatten_groups(groups: Optional[Sequence[Sequence[int]]]) -> tuple[ctypes.Array, int, ctypes.Array, int]:
    """Per-group block id lists -> (flat int64 array, n, group lengths, n_groups)."""
    if groups is not None and len(groups) == 1:
        # One KV-cache group (every model without sliding windows): no
        # intermediate lists.
        g = groups[0]
        n = len(g)
        return (ctypes.c_int64 * n)(*g), n, (ctypes.c_int64 * 1)(n), 1
    lists = [list(g) for g in (groups or ())]
    flat = [b for g in lists for b in g]
    ids = (ctypes.c_int64 * len(flat))(*flat)
    lens = (ctypes.c_int64 * len(lists))(*[len(g) for g in lists])
    return ids, len(flat), lens, len(lists)


def layer_descriptions(
    kv_caches: Mapping[str, Any], specs: Optional[Mapping[str, tuple[int, str, int]]] = None
) -> list[dict[str, Any]]:
    """What the library needs of each KV-cache tensor: addresses, storage,
    shape, strides, element size, device. specs maps a layer name to its
    (KV-cache group, kind, sliding window); a layer without one is in group
    0, full attention, unless specs is given (then it is skipped by the
    library, as vLLM's connector skips layers without a KV-cache spec)."""
    out = []
    for name, t in kv_caches.items():
        st = t.untyped_storage()
        if specs is None:
            group, kind, window = 0, "full", 0
        else:
            group, kind, window = specs.get(name, (-1, "", 0))
        out.append(
            {
                "name": name,
                "group": group,
                "kind": kind,
                "sliding_window": window,
                "data_ptr": t.data_ptr(),
                "storage_ptr": st.data_ptr(),
                "storage_bytes": st.nbytes(),
                "elem_size": t.element_size(),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "device": t.device.type,
                "device_index": t.device.index if t.device.index is not None else 0,
            }
        )
    return out


def library_version() -> str:
    """The library's version string."""
    return _lib.call_bytes("gonixl_version").decode()


def live_objects() -> dict[str, int]:
    """The library's open scheduler and worker handles and parked results."""
    return json.loads(_lib.call_bytes("gonixl_live_objects"))


def probe() -> dict[str, Any]:
    """What the library finds on this host: version and transfer engines."""
    return json.loads(_lib.call_bytes("gonixl_probe"))


class Finished(NamedTuple):
    """A worker's get_finished: the request ids finished sending, finished
    receiving and failed receiving since the last call; the blocks to
    reshape per request (read from a prefill of a smaller block size:
    per group {"ratio", "blocks", "covered"}); and whether load_errors and
    stats have something to return, and push_arrivals (push mode, a
    prefill)."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]
    reshape: dict[str, list[dict[str, Any]]]
    load_errors_pending: bool
    stats_pending: bool
    push_arrivals_pending: bool = False
    digests_pending: bool = False


_HEAD = struct.Struct("<6I")
_U32 = struct.Struct("<I")
_GROUP = struct.Struct("<3I")
FINISHED_VERSION = 1
FINISHED_LOAD_ERRORS_PENDING = 1
FINISHED_STATS_PENDING = 2
FINISHED_PUSH_ARRIVALS_PENDING = 4
FINISHED_DIGESTS_PENDING = 8


def decode_finished(b: bytes) -> Finished:
    """gonixl_worker_get_finished's binary form (include/gonixl.h)."""
    version, flags, ns, nr, nf, nx = _HEAD.unpack_from(b, 0)
    if version != FINISHED_VERSION:
        raise ValueError(f"get_finished result version {version}, this package reads {FINISHED_VERSION}")
    if not (ns or nr or nf or nx):
        return Finished(
            set(),
            set(),
            set(),
            {},
            bool(flags & FINISHED_LOAD_ERRORS_PENDING),
            bool(flags & FINISHED_STATS_PENDING),
            bool(flags & FINISHED_PUSH_ARRIVALS_PENDING),
            bool(flags & FINISHED_DIGESTS_PENDING),
        )
    off = _HEAD.size
    lists: list[set[str]] = []
    for n in (ns, nr, nf):
        ids = set()
        for _ in range(n):
            (ln,) = _U32.unpack_from(b, off)
            off += 4
            ids.add(b[off : off + ln].decode())
            off += ln
        lists.append(ids)
    reshape: dict[str, list[dict[str, Any]]] = {}
    for _ in range(nx):
        (ln,) = _U32.unpack_from(b, off)
        rid = b[off + 4 : off + 4 + ln].decode()
        off += 4 + ln
        (ng,) = _U32.unpack_from(b, off)
        off += 4
        groups = []
        for _ in range(ng):
            ratio, covered, nb = _GROUP.unpack_from(b, off)
            off += _GROUP.size
            blocks = list(struct.unpack_from(f"<{nb}q", b, off))
            off += 8 * nb
            groups.append({"ratio": ratio, "blocks": blocks, "covered": covered})
        reshape[rid] = groups
    return Finished(
        lists[0],
        lists[1],
        lists[2],
        reshape,
        bool(flags & FINISHED_LOAD_ERRORS_PENDING),
        bool(flags & FINISHED_STATS_PENDING),
        bool(flags & FINISHED_PUSH_ARRIVALS_PENDING),
        bool(flags & FINISHED_DIGESTS_PENDING),
    )


Params = Union[bytes, Mapping[str, Any], None]
"""kv_transfer_params: a dict, or the JSON bytes of one (what a caller that
already serialised it passes), or None / b"" for none."""


def _new(fn: str, config: Union[bytes, Mapping[str, Any]], role: str) -> int:
    """A handle from gonixl_<role>_new; config is the connector
    configuration (a dict, whose role is set here, or its JSON)."""
    cfg = config if isinstance(config, bytes) else json.dumps({**config, "role": role}).encode()
    h = _lib.handle_t()
    _lib.call(fn, cfg, len(cfg), ctypes.byref(h))
    return h.value


def _j(x: Params) -> bytes:
    if isinstance(x, bytes):
        return x
    return json.dumps(x).encode() if x else b""


def _ids_json(ids: Iterable[str]) -> bytes:
    return json.dumps(sorted(ids)).encode()


#: A scheduler batch op's result bits (include/gonixl.h).
OP_MUTATED = 1
OP_INVALID = 2
#: A result byte the library did not write (the batch was not applied).
_NOT_APPLIED = 0xFF


def _op_str(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _op_i64s(v: Sequence[int]) -> bytes:
    return struct.pack(f"<I{len(v)}q", len(v), *v)


def _op_groups(groups: Optional[Sequence[Sequence[int]]]) -> bytes:
    gs = list(groups or ())
    return struct.pack("<I", len(gs)) + b"".join(_op_i64s(g) for g in gs)


class Scheduler:
    """The scheduler side (vLLM's EngineCore): request bookkeeping, leases,
    the side-channel listener. config is the connector configuration
    (docs/ENVIRONMENT.md; the keys of include/gonixl.h's config JSON).

    This class and :class:`Worker` are the one binding of the C ABI: every
    call into the library goes through them (gonixl.vllm too), and a bad
    argument surfaces as one of :mod:`gonixl.errors`' exceptions."""

    def __init__(self, config: Union[bytes, Mapping[str, Any]]):
        self.handle = _new("gonixl_scheduler_new", config, "scheduler")
        # The batch (include/gonixl.h, "Scheduler batches"): calls whose
        # answer the caller does not wait for, carried by the next call that
        # reads what they change (build_meta, normally: one crossing a step).
        self._ops = bytearray()
        self._then: list[Optional[Callable[[int], None]]] = []
        self._meta_out: Optional[_lib.Buffer] = None

    @property
    def pending_ops(self) -> int:
        """Calls queued for the next crossing."""
        return len(self._then)

    def _queue(self, kind: int, body: bytes, then: Optional[Callable[[int], None]] = None) -> None:
        self._ops += struct.pack("<BI", kind, len(body)) + body
        self._then.append(then)

    def _take_ops(self) -> tuple[bytes, Any, list[Optional[Callable[[int], None]]]]:
        ops, then = bytes(self._ops), self._then
        self._ops, self._then = bytearray(), []
        # Unwritten results stay _NOT_APPLIED: a call that failed before
        # applying the batch runs no callback.
        return ops, (ctypes.c_uint8 * len(then))(*([_NOT_APPLIED] * len(then))), then

    @staticmethod
    def _results(res: Any, then: list[Optional[Callable[[int], None]]]) -> None:
        """Runs each applied op's callback, all of them even if one raises
        (the first exception is raised after)."""
        failed: Optional[BaseException] = None
        for i, cb in enumerate(then):
            if cb is not None and res[i] != _NOT_APPLIED:
                try:
                    cb(res[i])
                except Exception as e:  # re-raised below
                    failed = failed or e
        if failed is not None:
            raise failed

    def flush(self) -> None:
        """Applies the queued calls now (every call but
        get_num_new_matched_tokens does so first)."""
        if not self._then:
            return
        ops, res, then = self._take_ops()
        try:
            _lib.call("gonixl_scheduler_apply", self.handle, ops, len(ops), res, len(then))
        finally:
            self._results(res, then)

    def on_new_request(self, req_id: str, params: Params) -> None:
        """Queued (op 1). Params the library refuses are logged by it."""
        p = _j(params)
        if p:
            self._queue(1, _op_str(req_id.encode()) + _op_str(p))

    def get_num_new_matched_tokens(self, params: Params, num_prompt_tokens: int, num_computed_tokens: int) -> tuple[int, bool]:
        p = _j(params)
        count, is_async = ctypes.c_int64(0), ctypes.c_int32(0)
        _lib.call(
            "gonixl_scheduler_get_num_new_matched_tokens",
            self.handle,
            p,
            len(p),
            num_prompt_tokens,
            num_computed_tokens,
            ctypes.byref(count),
            ctypes.byref(is_async),
        )
        return count.value, bool(is_async.value)

    def update_state_after_alloc(
        self,
        req_id: str,
        params: Params,
        block_ids: Sequence[Sequence[int]],
        cached_blocks: Sequence[int],
        num_external_tokens: int,
    ) -> bool:
        """Returns whether the request's params now say its remote blocks
        were taken care of (vLLM then sets do_remote_prefill to False)."""
        self.flush()
        r, p = req_id.encode(), _j(params)
        ids, n, lens, ng = flatten_groups(block_ids if num_external_tokens > 0 else ())
        comp = (ctypes.c_int64 * len(cached_blocks))(*cached_blocks)
        mutated = ctypes.c_int32(0)
        _lib.call(
            "gonixl_scheduler_update_state_after_alloc",
            self.handle,
            r,
            len(r),
            p,
            len(p),
            ids,
            n,
            lens,
            ng,
            comp,
            len(cached_blocks),
            num_external_tokens,
            ctypes.byref(mutated),
        )
        return bool(mutated.value)

    def update_state_after_alloc_later(
        self,
        req_id: str,
        params: Params,
        block_ids: Sequence[Sequence[int]],
        cached_blocks: Sequence[int],
        num_external_tokens: int,
        then: Callable[[bool], None],
    ) -> None:
        """update_state_after_alloc, queued (op 2): then(mutated) runs when
        the batch is applied; not at all when the library refused the
        params (it logs why)."""
        p = _j(params)
        groups = _op_groups(block_ids if num_external_tokens > 0 else ())
        op = _op_str(req_id.encode()) + _op_str(p) + groups + _op_i64s(cached_blocks)
        op += struct.pack("<q", num_external_tokens)

        def done(res: int) -> None:
            if not res & OP_INVALID:
                then(bool(res & OP_MUTATED))

        self._queue(2, op, done)

    def request_finished_later(
        self, req_id: str, params: Params, block_ids: Sequence[Sequence[int]], finished_normally: bool, num_computed_tokens: int
    ) -> None:
        """request_finished of a decode without bidirectional transfer,
        queued (op 3): its answer is always (False, None); the library
        refuses any other."""
        p = _j(params)
        op = (
            _op_str(req_id.encode())
            + _op_str(p)
            + struct.pack("<Bq", 1 if finished_normally else 0, num_computed_tokens)
            + _op_groups(block_ids)
        )
        self._queue(3, op)

    def push_prompt_done(self, req_id: str, params: Params, block_ids: Sequence[Sequence[int]], num_tokens: int = 0) -> None:
        """Push mode, a prefill: the step being scheduled completes this
        request's prompt of num_tokens tokens (include/gonixl.h)."""
        self.flush()
        r, p = req_id.encode(), _j(params)
        ids, n, lens, ng = flatten_groups(block_ids)
        _lib.call("gonixl_scheduler_push_prompt_done", self.handle, r, len(r), p, len(p), ids, n, lens, ng, num_tokens)

    def push_preempted(self, req_ids: Iterable[str]) -> None:
        """Push mode, a prefill: the requests vLLM preempted this step."""
        self.flush()
        j = _ids_json(req_ids)
        if j != b"[]":
            _lib.call("gonixl_scheduler_push_preempted", self.handle, j, len(j))

    def pending_block_frees(self) -> tuple[bool, bool]:
        """vLLM's has_pending_block_frees (push mode's announced prompts),
        and whether the call handed stale announcements to the workers as
        preemptions."""
        self.flush()
        out = ctypes.c_int32(0)
        _lib.call("gonixl_scheduler_pending_block_frees", self.handle, ctypes.byref(out))
        return bool(out.value & 1), bool(out.value & 2)

    def build_meta(self) -> bytes:
        """This step's metadata for the workers; b"" for an idle step (no
        work, no timer due; idle until another scheduler call, for
        idle_for() seconds)."""
        if self._meta_out is None:
            self._meta_out = _lib.Buffer(4096)
        if not self._then:
            return _lib.call_into(self._meta_out, "gonixl_scheduler_build_meta", self.handle)
        ops, res, then = self._take_ops()
        try:
            return _lib.call_into(self._meta_out, "gonixl_scheduler_apply_build_meta", self.handle, ops, len(ops), res, len(then))
        finally:
            # Also when the metadata failed after the batch was applied.
            self._results(res, then)

    def idle_for(self) -> float:
        """After build_meta answered b"": seconds the next steps stay idle
        unless another scheduler call is made (a heartbeat's due time); -1
        when nothing is timed, 0 when there is work now."""
        self.flush()
        out = ctypes.c_double(0.0)
        _lib.call("gonixl_scheduler_idle_for", self.handle, ctypes.byref(out))
        return out.value

    def update_connector_output(self, finished_recving: Iterable[str]) -> None:
        """Queued (op 4)."""
        ids = [r.encode() for r in finished_recving]
        if ids:
            self._queue(4, struct.pack("<I", len(ids)) + b"".join(_op_str(r) for r in ids))

    def kv_digests(self, digests: Mapping[str, Any]) -> None:
        """The workers' digests of blocks held for a read-back, by request
        id (None: not digested); the side channel serves them."""
        self.flush()
        j = json.dumps(digests).encode()
        _lib.call("gonixl_scheduler_kv_digests", self.handle, j, len(j))

    def request_finished(
        self,
        req_id: str,
        params: Params,
        block_ids: Sequence[Sequence[int]],
        finished_normally: bool,
        num_computed_tokens: int,
    ) -> tuple[bool, Optional[dict[str, Any]]]:
        """(delay_free_blocks, kv_transfer_params for the response)."""
        self.flush()
        r, p = req_id.encode(), _j(params)
        ids, n, lens, ng = flatten_groups(block_ids)
        delay = ctypes.c_int32(0)
        out = _lib.call_bytes(
            "gonixl_scheduler_request_finished",
            self.handle,
            r,
            len(r),
            p,
            len(p),
            1 if finished_normally else 0,
            num_computed_tokens,
            ids,
            n,
            lens,
            ng,
            ctypes.byref(delay),
            initial=256 + 16 * n,
        )
        return bool(delay.value), (_loads(out) if out else None)

    def set_handshake_payload(self, pp_rank: int, tp_rank: int, payload: bytes) -> None:
        self.flush()
        _lib.call("gonixl_scheduler_set_handshake_payload", self.handle, pp_rank, tp_rank, payload, len(payload))

    def live(self) -> dict[str, int]:
        self.flush()
        return json.loads(_lib.call_bytes("gonixl_scheduler_live", self.handle, initial=256))

    def close(self) -> None:
        if self.handle:
            self._ops, self._then = bytearray(), []  # nothing left to apply them to
            h, self.handle = self.handle, 0
            _lib.call("gonixl_scheduler_close", h)


class Worker:
    """The worker side (one per TP/PP rank): KV registration, handshakes,
    READs, notifications."""

    def __init__(self, config: Union[bytes, Mapping[str, Any]]):
        self.handle = _new("gonixl_worker_new", config, "worker")
        self._out: Optional[_lib.Buffer] = None

    def register_kv_caches(
        self,
        layers: list[dict[str, Any]],
        num_blocks: int,
        block_size: int,
        attn_backend: str = "",
        kv_cache_layout: str = "",
        block_reshape: str = "",
        kernel_layout: str = "",
        head_size: int = 0,
    ) -> bytes:
        """Registers the KV caches (layers from :func:`layer_descriptions`)
        and returns the handshake payload the scheduler serves.
        block_reshape is :attr:`BlockReshaper.mode` when the caller puts
        blocks read from a prefill of a smaller block size in order (see
        get_finished's "reshape"); "" refuses such prefills. kernel_layout
        names the attention kernel's layout inside a block where the
        backend does not fix it (vLLM's CPU backend)."""
        init = {
            "layers": layers,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "attn_backend": attn_backend,
            "kv_cache_layout": kv_cache_layout,
            "block_reshape": block_reshape,
            "kernel_layout": kernel_layout,
            "head_size": head_size,
        }
        j = json.dumps(init).encode()
        _lib.call("gonixl_worker_register_kv_caches", self.handle, j, len(j))
        return _lib.call_bytes("gonixl_worker_handshake_payload", self.handle)

    def handle_preemptions(self, meta: bytes) -> None:
        _lib.call("gonixl_worker_handle_preemptions", self.handle, meta, len(meta))

    def start_load_kv(self, meta: bytes) -> None:
        _lib.call("gonixl_worker_start_load_kv", self.handle, meta, len(meta))

    def get_finished(self) -> Finished:
        """What finished since the last call (include/gonixl.h's binary
        form, decoded into the sets vLLM's results are made of)."""
        if self._out is None:
            self._out = _lib.Buffer(4096)
        return decode_finished(_lib.call_into(self._out, "gonixl_worker_get_finished", self.handle))

    def state(self) -> _lib.WorkerState:
        """The worker's idle state (busy, seq), in memory the library keeps
        current: read its fields without a call (include/gonixl.h)."""
        p = ctypes.POINTER(_lib.WorkerState)()
        _lib.call("gonixl_worker_state", self.handle, ctypes.byref(p))
        return p.contents

    def push_arrivals(self) -> list[str]:
        """Base request ids of the decode registrations that arrived since
        the last call (push mode, a prefill)."""
        return json.loads(_lib.call_bytes("gonixl_worker_push_arrivals", self.handle, initial=256))

    def kv_digest(self, reqs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The digests of the blocks of requests whose prompt KV the step
        just made final (reqs: {"id", "tokens", "blocks"}), by request id:
        {"blocks": [[digest] per group], "regions": [[sum] per group]}."""
        j = json.dumps(reqs).encode()
        return _loads(_lib.call_bytes("gonixl_worker_kv_digest", self.handle, j, len(j), initial=4096 + 24 * sum(
            len(g) for r in reqs for g in r["blocks"])))

    def kv_digest_held(self, reqs: Sequence[Mapping[str, Any]]) -> None:
        """Starts hashing a bidirectional decode's read-back holds (reqs as
        for kv_digest) off this thread; their finished_sending waits for it,
        and get_finished's digests_pending says when kv_digests_ready has
        them."""
        j = json.dumps(reqs).encode()
        _lib.call("gonixl_worker_kv_digest_held", self.handle, j, len(j))

    def kv_digests_ready(self) -> dict[str, Any]:
        """The digests kv_digest_held finished since the last call, by
        request id (kv_digest's answer form)."""
        return _loads(_lib.call_bytes("gonixl_worker_kv_digests_ready", self.handle, initial=4096))

    def load_errors(self) -> list[int]:
        return json.loads(_lib.call_bytes("gonixl_worker_load_errors", self.handle, initial=64))

    def stats(self) -> Optional[dict[str, Any]]:
        raw = _lib.call_bytes("gonixl_worker_stats", self.handle)
        return json.loads(raw) if raw else None

    def metrics_text(self) -> str:
        return _lib.call_bytes("gonixl_worker_metrics", self.handle, initial=16384).decode()

    def live(self) -> dict[str, int]:
        return json.loads(_lib.call_bytes("gonixl_worker_live", self.handle, initial=256))

    def close(self) -> None:
        if self.handle:
            h, self.handle = self.handle, 0
            _lib.call("gonixl_worker_close", h)


def block_dim(shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of a KV-cache tensor that indexes blocks (the
    library's rule: FlashAttention's [2, num_blocks, ...] first)."""
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        return 1
    for i, s in enumerate(shape):
        if s == num_blocks:
            return i
    raise ValueError(f"no dimension of shape {list(shape)} equals num_blocks={num_blocks}")


class HostStaging:
    """kv_buffer_device "cpu" for KV caches in device memory, as vLLM's
    NixlConnector does it: every layer gets a pinned host mirror with the
    device tensor's shape and strides; the mirrors are what the engine
    registers (as DRAM) and moves; a prefill copies a request's blocks to
    its mirror before the blocks can be read (save_to_host, in the step
    that computed them: vLLM's wait_for_save), a decode copies the blocks
    it read to the device before reporting them received (load_to_device).
    Both copies are synchronous, as vLLM's are."""

    def __init__(self, kv_caches: Mapping[str, Any], num_blocks: int):
        import torch

        self.device_caches = dict(kv_caches)
        self.host_caches = {}
        self.dims = {}
        pin = torch.cuda.is_available()  # pinned memory needs a CUDA runtime
        for name, t in kv_caches.items():
            self.dims[name] = block_dim(t.shape, num_blocks)
            self.host_caches[name] = torch.empty_strided(
                tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu", pin_memory=pin
            )

    def _copy(self, src: Mapping[str, Any], dst: Mapping[str, Any], block_ids: Sequence[int]) -> None:
        import torch

        if not block_ids:
            return
        idx = {}
        for name, s in src.items():
            d, bd = dst[name], self.dims[name]
            for t in (s, d):
                if t.device not in idx:
                    idx[t.device] = torch.tensor(list(block_ids), dtype=torch.long, device=t.device)
            # To the device the copy may run ahead (stream-ordered before the
            # index_copy_); to the host it must have landed before the
            # host-side index_copy_ reads it.
            moved = s.index_select(bd, idx[s.device]).to(d.device, non_blocking=d.device.type != "cpu")
            d.index_copy_(bd, idx[d.device], moved)
        for dev in idx:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

    def save_to_host(self, block_ids: Sequence[int]) -> None:
        """Device -> host mirror, for the given blocks of every layer."""
        self._copy(self.device_caches, self.host_caches, block_ids)

    def load_to_device(self, block_ids: Sequence[int]) -> None:
        """Host mirror -> device, for the given blocks of every layer."""
        self._copy(self.host_caches, self.device_caches, block_ids)


class BlockReshaper:
    """Puts blocks read from a prefill of a smaller block size in this
    engine's token order (vLLM's block_size_ratio post-processing).

    The library reads remote blocks of ``block_size / ratio`` tokens one
    after another into each local block (its sub-blocks). A block is a
    sequence of segments, each ``[runs, tokens, elements]`` in memory order:
    one segment of one run for a token-major block (NHD, MLA), one run per
    head for a head-major one (HND), and for the CPU attention backend's
    vec kernels one segment per head for K (``[head_size, tokens]``:
    column-major, a run per head dimension of one element a token) and one
    for V (``[tokens, head_size]``). A sub-block has the same segments with
    fewer tokens, so every element of the local block is found in one
    sub-block: the permutation is computed once per (block length, ratio)
    and applied as one gather per layer. Token positions past what the READ
    wrote (the end of the prompt in the last block) are zeroed, as vLLM
    does.

    ``kind`` is "cpu_vec", "head_major", "token_major", or "" when this
    layout has no known token order (the library then refuses a prefill of
    another block size at handshake); :attr:`mode` is ``kind`` unless the
    tensors do not fit it."""

    def __init__(
        self,
        kv_caches: Mapping[str, Any],
        num_blocks: int,
        block_size: int,
        head_size: int,
        kind: str,
        skip: Optional[set[str]] = None,
    ):
        self.block_size = block_size
        self.head_size = head_size
        self.mode = kind
        self.views: list[Any] = []  # blocks x elements, in memory order
        self._perm: dict[tuple[int, int, str], tuple[Any, Any]] = {}
        if not kind:
            return
        try:
            self._collect(kv_caches, num_blocks, skip)
        except (ValueError, RuntimeError, IndexError):
            # A tensor this cannot walk: no reshaping, so the library
            # refuses prefills of another block size (registration itself
            # is the library's business, not this class's).
            self.mode, self.views = "", []

    def _collect(self, kv_caches: Mapping[str, Any], num_blocks: int, skip: Optional[set[str]]) -> None:
        seen: set[int] = set()
        for name, t in kv_caches.items():
            if skip and name in skip:
                continue
            d = block_dim(t.shape, num_blocks)
            for idx in itertools.product(*(range(n) for n in t.shape[:d])):
                sub = t[idx] if idx else t
                if sub.data_ptr() in seen:
                    continue
                seen.add(sub.data_ptr())
                inner = sub[0].numel()
                if not _dense(sub[0]) or self._segments(inner) is None:
                    self.mode = ""
                    self.views = []
                    return
                self.views.append(sub.as_strided((num_blocks, inner), (sub.stride(0), 1)))

    def _segments(self, inner: int) -> Optional[list[tuple[int, int]]]:
        """The block's segments as (runs, elements a token), or None."""
        bs, hd = self.block_size, self.head_size
        if self.mode == "token_major":
            return [(1, inner // bs)] if inner % bs == 0 else None
        if self.mode == "head_major":
            return [(inner // (bs * hd), hd)] if hd and inner % (bs * hd) == 0 else None
        if self.mode == "cpu_vec":
            per_head = 2 * bs * hd
            return [(hd, 1), (1, hd)] * (inner // per_head) if hd and inner % per_head == 0 else None
        return None

    def _permutation(self, inner: int, ratio: int, device: Any) -> tuple[Any, Any]:
        """(src, token) on device: element p of a local block comes from
        element src[p] of the received bytes, and holds token position
        token[p]. Computed once per (block length, ratio, device)."""
        key = (inner, ratio, str(device))
        if key not in self._perm:
            import torch

            bs, sub = self.block_size, self.block_size // ratio
            src, tok = [], []
            off = 0
            for runs, elems in self._segments(inner) or []:
                a = torch.arange(runs).view(runs, 1, 1)
                t = torch.arange(bs).view(1, bs, 1)
                e = torch.arange(elems).view(1, 1, elems)
                j, t2 = t // sub, t % sub
                q = j * (inner // ratio) + off // ratio + (a * sub + t2) * elems + e
                src.append(q.reshape(-1))
                tok.append(t.expand(runs, bs, elems).reshape(-1))
                off += runs * bs * elems
            self._perm[key] = (torch.cat(src).to(device), torch.cat(tok).to(device))
        return self._perm[key]

    def apply(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """entries: get_finished's "reshape" list of one request: per KV-cache
        group, {"ratio", "blocks", "covered"}."""
        import torch

        for e in entries:
            ratio, blocks, covered = int(e["ratio"]), list(e["blocks"]), int(e["covered"])
            if ratio <= 1 or not blocks:
                continue
            full, part = divmod(covered, ratio)
            idx: dict[str, Any] = {}  # the block ids, once per device
            for view in self.views:
                src, tok = self._permutation(view.shape[1], ratio, view.device)
                ids = idx.setdefault(str(view.device), torch.tensor(blocks, dtype=torch.long, device=view.device))
                x = view.index_select(0, ids)[:, src]
                if full < len(blocks):
                    # Past the last sub-block written: no prompt token.
                    x[full, tok >= part * (self.block_size // ratio)] = 0
                    x[full + 1 :] = 0
                view.index_copy_(0, ids, x)


def _dense(t: Any) -> bool:
    """Whether t's elements form one dense run (in any dimension order)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    want = 1
    for s, n in dims:
        if s != want:
            return False
        want *= n
    return True
