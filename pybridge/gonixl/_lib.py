"""ctypes binding of libgonixl.so.

The prototypes below follow include/gonixl.h in header order; the C
declaration each one mirrors is repeated above it. tests/abi_check.py
compares this list with the header and with the library's exported symbols.

Nothing is loaded at import time: vLLM forks worker processes, and a Go
runtime does not survive fork. The library is loaded by the first call to
:func:`lib` in a process; a process that forks after that must not use the
library in the child.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable, Optional

from . import errors

#: Must equal GONIXL_ABI_VERSION in include/gonixl.h.
ABI_VERSION = 7

ERROR_MESSAGE_SIZE = 512

status_t = ctypes.c_int32
handle_t = ctypes.c_uint64
size_p = ctypes.POINTER(ctypes.c_size_t)


class Error(ctypes.Structure):
    """gonixl_error_t."""

    _fields_ = [("code", ctypes.c_int32), ("message", ctypes.c_char * ERROR_MESSAGE_SIZE)]


error_p = ctypes.POINTER(Error)


class WorkerState(ctypes.Structure):
    """gonixl_worker_state_t: a worker's idle state, written by the library,
    read here without a call."""

    _fields_ = [("seq", ctypes.c_uint64), ("busy", ctypes.c_uint32), ("reserved", ctypes.c_uint32)]


worker_state_pp = ctypes.POINTER(ctypes.POINTER(WorkerState))

i64 = ctypes.c_int64
i32 = ctypes.c_int32
i64_p = ctypes.POINTER(ctypes.c_int64)
i32_p = ctypes.POINTER(ctypes.c_int32)
f64_p = ctypes.POINTER(ctypes.c_double)
u8_p = ctypes.POINTER(ctypes.c_uint8)
handle_p = ctypes.POINTER(handle_t)
buf = ctypes.c_char_p
size = ctypes.c_size_t

#: (name, restype, argtypes) in header order; the C declaration is in
#: include/gonixl.h, where each function is documented.
PROTOTYPES: list[tuple[str, object, list]] = [
    # uint32_t gonixl_abi_version(void);
    ("gonixl_abi_version", ctypes.c_uint32, []),
    # gonixl_status_t gonixl_version(char *buf, size_t *len, gonixl_error_t *err);
    ("gonixl_version", status_t, [buf, size_p, error_p]),
    # gonixl_status_t gonixl_probe(char *buf, size_t *len, gonixl_error_t *err);
    ("gonixl_probe", status_t, [buf, size_p, error_p]),
    # gonixl_status_t gonixl_scheduler_new(char *config_json, size_t config_len,
    #     gonixl_scheduler_t *out, gonixl_error_t *err);
    ("gonixl_scheduler_new", status_t, [buf, size, handle_p, error_p]),
    # gonixl_status_t gonixl_scheduler_get_num_new_matched_tokens(gonixl_scheduler_t h,
    #     char *params_json, size_t params_len, int64_t num_prompt_tokens,
    #     int64_t num_computed_tokens, int64_t *out_count, int32_t *out_async, gonixl_error_t *err);
    ("gonixl_scheduler_get_num_new_matched_tokens", status_t, [handle_t, buf, size, i64, i64, i64_p, i32_p, error_p]),
    # gonixl_status_t gonixl_scheduler_update_state_after_alloc(gonixl_scheduler_t h,
    #     char *req_id, size_t req_id_len, char *params_json, size_t params_len,
    #     int64_t *block_ids, int64_t num_block_ids, int64_t *group_lens, int64_t num_groups,
    #     int64_t *num_computed, int64_t num_computed_len, int64_t num_external_tokens,
    #     int32_t *out_mutated, gonixl_error_t *err);
    (
        "gonixl_scheduler_update_state_after_alloc",
        status_t,
        [handle_t, buf, size, buf, size, i64_p, i64, i64_p, i64, i64_p, i64, i64, i32_p, error_p],
    ),
    # gonixl_status_t gonixl_scheduler_build_meta(gonixl_scheduler_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_scheduler_build_meta", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_scheduler_apply(gonixl_scheduler_t h, char *ops, size_t ops_len,
    #     uint8_t *results, int64_t num_ops, gonixl_error_t *err);
    ("gonixl_scheduler_apply", status_t, [handle_t, buf, size, u8_p, i64, error_p]),
    # gonixl_status_t gonixl_scheduler_apply_build_meta(gonixl_scheduler_t h, char *ops, size_t ops_len,
    #     uint8_t *results, int64_t num_ops, char *buf, size_t *len, gonixl_error_t *err);
    ("gonixl_scheduler_apply_build_meta", status_t, [handle_t, buf, size, u8_p, i64, buf, size_p, error_p]),
    # gonixl_status_t gonixl_scheduler_idle_for(gonixl_scheduler_t h, double *out, gonixl_error_t *err);
    ("gonixl_scheduler_idle_for", status_t, [handle_t, f64_p, error_p]),
    # gonixl_status_t gonixl_scheduler_request_finished(gonixl_scheduler_t h,
    #     char *req_id, size_t req_id_len, char *params_json, size_t params_len,
    #     int32_t finished_normally, int64_t num_computed_tokens,
    #     int64_t *block_ids, int64_t num_block_ids, int64_t *group_lens, int64_t num_groups,
    #     int32_t *out_delay, char *out_params, size_t *out_len, gonixl_error_t *err);
    (
        "gonixl_scheduler_request_finished",
        status_t,
        [handle_t, buf, size, buf, size, i32, i64, i64_p, i64, i64_p, i64, i32_p, buf, size_p, error_p],
    ),
    # gonixl_status_t gonixl_scheduler_push_prompt_done(gonixl_scheduler_t h, char *req_id,
    #     size_t req_id_len, char *params_json, size_t params_len, int64_t *block_ids,
    #     int64_t num_block_ids, int64_t *group_lens, int64_t num_groups, int64_t num_tokens,
    #     gonixl_error_t *err);
    (
        "gonixl_scheduler_push_prompt_done",
        status_t,
        [handle_t, buf, size, buf, size, i64_p, i64, i64_p, i64, i64, error_p],
    ),
    # gonixl_status_t gonixl_scheduler_push_preempted(gonixl_scheduler_t h, char *req_ids_json,
    #     size_t json_len, gonixl_error_t *err);
    ("gonixl_scheduler_push_preempted", status_t, [handle_t, buf, size, error_p]),
    # gonixl_status_t gonixl_scheduler_pending_block_frees(gonixl_scheduler_t h, int32_t *out,
    #     gonixl_error_t *err);
    ("gonixl_scheduler_pending_block_frees", status_t, [handle_t, i32_p, error_p]),
    # gonixl_status_t gonixl_scheduler_kv_digests(gonixl_scheduler_t h, char *digests_json,
    #     size_t json_len, gonixl_error_t *err);
    ("gonixl_scheduler_kv_digests", status_t, [handle_t, buf, size, error_p]),
    # gonixl_status_t gonixl_scheduler_set_handshake_payload(gonixl_scheduler_t h, int32_t pp_rank,
    #     int32_t tp_rank, char *payload, size_t payload_len, gonixl_error_t *err);
    ("gonixl_scheduler_set_handshake_payload", status_t, [handle_t, i32, i32, buf, size, error_p]),
    # gonixl_status_t gonixl_scheduler_close(gonixl_scheduler_t h, gonixl_error_t *err);
    ("gonixl_scheduler_close", status_t, [handle_t, error_p]),
    # gonixl_status_t gonixl_scheduler_live(gonixl_scheduler_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_scheduler_live", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_new(char *config_json, size_t config_len,
    #     gonixl_worker_t *out, gonixl_error_t *err);
    ("gonixl_worker_new", status_t, [buf, size, handle_p, error_p]),
    # gonixl_status_t gonixl_worker_register_kv_caches(gonixl_worker_t h, char *init_json,
    #     size_t init_len, gonixl_error_t *err);
    ("gonixl_worker_register_kv_caches", status_t, [handle_t, buf, size, error_p]),
    # gonixl_status_t gonixl_worker_handshake_payload(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_handshake_payload", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_handle_preemptions(gonixl_worker_t h, char *meta, size_t meta_len,
    #     gonixl_error_t *err);
    ("gonixl_worker_handle_preemptions", status_t, [handle_t, buf, size, error_p]),
    # gonixl_status_t gonixl_worker_start_load_kv(gonixl_worker_t h, char *meta, size_t meta_len,
    #     gonixl_error_t *err);
    ("gonixl_worker_start_load_kv", status_t, [handle_t, buf, size, error_p]),
    # gonixl_status_t gonixl_worker_get_finished(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_get_finished", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_state(gonixl_worker_t h, gonixl_worker_state_t **out,
    #     gonixl_error_t *err);
    ("gonixl_worker_state", status_t, [handle_t, worker_state_pp, error_p]),
    # gonixl_status_t gonixl_worker_load_errors(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_load_errors", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_push_arrivals(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_push_arrivals", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_kv_digest(gonixl_worker_t h, char *reqs_json, size_t reqs_len,
    #     char *buf, size_t *len, gonixl_error_t *err);
    ("gonixl_worker_kv_digest", status_t, [handle_t, buf, size, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_kv_digest_held(gonixl_worker_t h, char *reqs_json,
    #     size_t reqs_len, gonixl_error_t *err);
    ("gonixl_worker_kv_digest_held", status_t, [handle_t, buf, size, error_p]),
    # gonixl_status_t gonixl_worker_kv_digests_ready(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_kv_digests_ready", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_stats(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_stats", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_metrics(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_metrics", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_live(gonixl_worker_t h, char *buf, size_t *len,
    #     gonixl_error_t *err);
    ("gonixl_worker_live", status_t, [handle_t, buf, size_p, error_p]),
    # gonixl_status_t gonixl_worker_close(gonixl_worker_t h, gonixl_error_t *err);
    ("gonixl_worker_close", status_t, [handle_t, error_p]),
    # gonixl_status_t gonixl_live_objects(char *buf, size_t *len, gonixl_error_t *err);
    ("gonixl_live_objects", status_t, [buf, size_p, error_p]),
    # gonixl_status_t gonixl_debug_panic(gonixl_error_t *err);
    ("gonixl_debug_panic", status_t, [error_p]),
]

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_loaded_pid: Optional[int] = None
_path: Optional[str] = None


def library_path() -> str:
    """Where the library is loaded from: GONIXL_LIB_PATH, else the copy
    installed inside this package."""
    env = os.environ.get("GONIXL_LIB_PATH")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libgonixl.so")


#: The calls vLLM's engine makes every step or per request. They return in
#: microseconds and never wait on the network (handshakes, NIXL's metadata
#: loads and descriptor preparation run on the library's own goroutines), so
#: they are made through ctypes.PyDLL, which keeps the GIL: a CDLL call
#: releases it, and taking it back waits for whichever Python thread of the
#: engine process holds it — up to the interpreter's 5 ms switch interval.
#: Measured inside vLLM (bench/timed_connector.py): a per-step call took
#: 48-215 µs at the median that way, its Go part under 4 µs. Everything
#: else (creating engines, registering caches, closing, metrics) releases
#: the GIL as before.
HOT = frozenset(
    {
        "gonixl_scheduler_get_num_new_matched_tokens",
        "gonixl_scheduler_update_state_after_alloc",
        "gonixl_scheduler_build_meta",
        "gonixl_scheduler_apply",
        "gonixl_scheduler_apply_build_meta",
        "gonixl_scheduler_idle_for",
        "gonixl_scheduler_request_finished",
        "gonixl_scheduler_push_prompt_done",
        "gonixl_scheduler_push_preempted",
        "gonixl_scheduler_pending_block_frees",
        "gonixl_scheduler_kv_digests",
        "gonixl_worker_start_load_kv",
        "gonixl_worker_get_finished",
        "gonixl_worker_load_errors",
        "gonixl_worker_stats",
        # Hashes a step's completed prompts (~1 ms for 14 MB, never waits):
        # released, the GIL cost more than the hashing in the bench.
        "gonixl_worker_kv_digest",
    }
)
_hot: dict[str, Callable[..., int]] = {}


def _declare(cdll: ctypes.CDLL) -> None:
    for name, restype, argtypes in PROTOTYPES:
        try:
            fn = getattr(cdll, name)
        except AttributeError as e:
            raise errors.LibraryLoadError(f"{_path}: missing symbol {name}: is the library older than the package?") from e
        fn.restype = restype
        fn.argtypes = argtypes


def lib() -> ctypes.CDLL:
    """Load (once per process) and return the library."""
    global _lib, _loaded_pid, _path
    if _lib is not None:
        if _loaded_pid != os.getpid():
            raise errors.LibraryLoadError(
                "libgonixl.so was loaded before this process forked; a Go runtime does not survive fork. "
                "Load gonixl only in the process that uses it."
            )
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        _path = library_path()
        if not os.path.exists(_path):
            raise errors.LibraryLoadError(f"libgonixl.so not found at {_path} (set GONIXL_LIB_PATH or run ./build.sh build)")
        # The native engines find their wheels' libraries and set their
        # environment defaults themselves (Go: nixl/internal/native).
        try:
            cdll = ctypes.CDLL(_path, mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise errors.LibraryLoadError(f"cannot load {_path}: {e}") from e
        _declare(cdll)
        got = cdll.gonixl_abi_version()
        if got != ABI_VERSION:
            raise errors.LibraryLoadError(
                f"{_path} has ABI version {got}, this package needs {ABI_VERSION}: rebuild with ./build.sh build"
            )
        # The same loaded library (dlopen counts references), called
        # without releasing the GIL: see HOT.
        pydll = ctypes.PyDLL(_path, mode=ctypes.RTLD_LOCAL)
        _declare(pydll)
        _hot.update((name, getattr(pydll, name)) for name in HOT)
        _lib = cdll
        _loaded_pid = os.getpid()
        return cdll


def is_loaded() -> bool:
    return _lib is not None


def call(fn_name: str, *args) -> int:
    """Call a status-returning function, raising on a negative status.
    Returns the status (OK or IN_PROGRESS)."""
    err = Error()
    cdll = lib()
    fn: Callable[..., int] = _hot.get(fn_name) or getattr(cdll, fn_name)
    st = fn(*args, ctypes.byref(err))
    if st < 0:
        raise errors.error_for(st, err.message.decode("utf-8", "replace"))
    return st


class Buffer:
    """An output buffer kept across calls (the per-step results): grown when
    the library asks for more, never allocated per call."""

    def __init__(self, size: int = 4096):
        self.buf = ctypes.create_string_buffer(size)
        self.n = ctypes.c_size_t(0)
        self.err = Error()


def call_into(b: Buffer, fn_name: str, *args) -> bytes:
    """call_bytes into a kept Buffer; only the bytes written are copied out."""
    cdll = lib()
    fn: Callable[..., int] = _hot.get(fn_name) or getattr(cdll, fn_name)
    for _ in range(3):
        b.n.value = len(b.buf)
        st = fn(*args, b.buf, ctypes.byref(b.n), ctypes.byref(b.err))
        if st == errors.ERR_BUFFER_TOO_SMALL:
            b.buf = ctypes.create_string_buffer(max(b.n.value, 2 * len(b.buf)))
            continue
        if st < 0:
            raise errors.error_for(st, b.err.message.decode("utf-8", "replace"))
        return ctypes.string_at(b.buf, b.n.value)
    raise errors.BufferTooSmallError(errors.ERR_BUFFER_TOO_SMALL, f"{fn_name}: size negotiation did not converge")


def call_bytes(fn_name: str, *args, initial: int = 4096) -> bytes:
    """Call a size-negotiated function: (..., buf, &len, err). Retries once
    with the size the library asks for."""
    size = initial
    cdll = lib()
    fn: Callable[..., int] = _hot.get(fn_name) or getattr(cdll, fn_name)
    for _ in range(3):
        buf = ctypes.create_string_buffer(size)
        n = ctypes.c_size_t(size)
        err = Error()
        st = fn(*args, buf, ctypes.byref(n), ctypes.byref(err))
        if st == errors.ERR_BUFFER_TOO_SMALL:
            size = max(n.value, 1)
            continue
        if st < 0:
            raise errors.error_for(st, err.message.decode("utf-8", "replace"))
        return buf.raw[: n.value]
    raise errors.BufferTooSmallError(errors.ERR_BUFFER_TOO_SMALL, f"{fn_name}: size negotiation did not converge")
