"""Connector wrappers of ./build.sh bench: the same timing around vLLM's stock
connectors and gonixl's, so that "time inside the connector" means the same
thing for both.

vLLM loads these as any out-of-tree connector::

    --kv-transfer-config '{"kv_connector": "TimedNixlConnector",
                           "kv_connector_module_path": "timed_connector", ...}'

with bench/ on PYTHONPATH. Each class is the connector it names, with every
method of vLLM's connector interface that the engine calls per step or per
request wrapped in a wall-clock timer (time.perf_counter). Nothing else
changes: arguments and results pass through untouched.

What is recorded, in GONIXL_BENCH_TIMING_DIR (one JSON-lines file per
process and role; nothing when the variable is unset):

- one line per engine step and role: ``{"k": "step", "r": role, "t": wall
  time at the step's end, "s": seconds spent in wrapped methods during the
  step, "c": the CPU seconds of the calling thread in them, "m": {method:
  seconds}}``. A scheduler step ends at
  ``build_connector_meta`` (the scheduler calls it once per step); a worker
  step ends at ``bind_connector_metadata`` (once per step, before the model
  runs); the time of a step's own closing call is counted in the next step.
- per request, on the scheduler side: ``{"k": "req", "id": request id,
  "arr": request arrival (vLLM's wall-clock arrival_time), "seen": first
  get_num_new_matched_tokens, "ready": when update_connector_output first
  reported the request in finished_recving (its KV is here), "fin": when
  request_finished was called}`` — written when the request finishes.

- with GONIXL_BENCH_SLOW_MS set (a diagnostic run), one line per wrapped
  call that took at least that many milliseconds: ``{"k": "slow", "r":
  role, "t": its end, "n": method, "w": wall seconds, "c": the calling
  thread's CPU seconds (Go's work inside a call into libgonixl.so runs on
  that thread), "q": seconds the thread waited runnable for a CPU
  (/proc/thread-self/schedstat)}``. What is left of "w" is time blocked
  (a lock, the GIL, I/O). Reading schedstat costs a few microseconds per
  call, outside the timed region, so plain runs leave it off.

Lines are buffered and written outside the timed region, at most once a
second, so the wrapper's own I/O never lands inside a measured call.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, NixlPushConnector

from gonixl.vllm import GoNixlConnector, GoNixlPushConnector

# Methods vLLM calls on the scheduler's connector and on the workers'. Only
# these are timed; setup (register_kv_caches, handshake metadata) is not part
# of a step.
SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "has_pending_block_frees",
    "has_pending_push_work",
    "take_events",
    "get_finished_count",
)
WORKER_METHODS = (
    "bind_connector_metadata",
    "clear_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "handle_preemptions",
    "finish_forward",
)


# With GONIXL_BENCH_LIBCALLS=1, gonixl's calls into libgonixl.so are timed
# too (per C function, in the step records' "lib" member), to tell the
# library's own time from the Python bridge's.
_LIB_TIMES: dict[str, float] = {}


def _time_lib_calls() -> None:
    from gonixl import _lib

    def wrap(inner: Any) -> Any:
        def f(fn_name: str, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(fn_name, *args, **kwargs)
            finally:
                _LIB_TIMES[fn_name] = _LIB_TIMES.get(fn_name, 0.0) + time.perf_counter() - t0

        return f

    _lib.call = wrap(_lib.call)
    _lib.call_bytes = wrap(_lib.call_bytes)


if os.environ.get("GONIXL_BENCH_LIBCALLS") == "1":
    _time_lib_calls()


_SLOW_S = float(os.environ.get("GONIXL_BENCH_SLOW_MS") or 0) / 1e3
_schedstat = threading.local()


def _runqueue_wait() -> float:
    """Seconds this thread has waited runnable for a CPU (0 without /proc).
    The file is opened once per thread and process (a forked child's
    thread-local copy names its parent's thread)."""
    fd = getattr(_schedstat, "fd", None)
    try:
        if fd is None or getattr(_schedstat, "pid", None) != os.getpid():
            fd = _schedstat.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            _schedstat.pid = os.getpid()
        return int(os.pread(fd, 128, 0).split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class _Recorder:
    """Per-role accumulation of one step's time and the file it goes to."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.step_s = 0.0
        self.step_c = 0.0
        self.step_m: dict[str, float] = {}
        self.reqs: dict[str, dict[str, float]] = {}
        self.lines: list[str] = []
        self.last_flush = time.monotonic()
        self.lock = threading.Lock()
        self.depth = threading.local()
        d = os.environ.get("GONIXL_BENCH_TIMING_DIR")
        self.path = os.path.join(d, f"{role}-{os.getpid()}.jsonl") if d else None
        if self.path is not None:
            # Writes what an idle engine (no steps) still holds: the last
            # requests' records before the bench stops the servers.
            threading.Thread(target=self._flusher, name="bench-timing-flush", daemon=True).start()

    def _flusher(self) -> None:
        while True:
            time.sleep(1.0)
            self.maybe_flush(force=True)

    def add(self, name: str, dt: float, cpu: float) -> None:
        with self.lock:
            self.step_s += dt
            self.step_c += cpu
            self.step_m[name] = self.step_m.get(name, 0.0) + dt

    def slow(self, name: str, wall: float, cpu: float, queued: float) -> None:
        with self.lock:
            self.lines.append(json.dumps({"k": "slow", "r": self.role, "t": time.time(), "n": name, "w": wall, "c": cpu, "q": queued}))

    def end_step(self) -> None:
        with self.lock:
            rec = {"k": "step", "r": self.role, "t": time.time(), "s": self.step_s, "c": self.step_c, "m": self.step_m}
            if _LIB_TIMES:
                rec["lib"] = dict(_LIB_TIMES)
                _LIB_TIMES.clear()
            self.lines.append(json.dumps(rec))
            self.step_s, self.step_c, self.step_m = 0.0, 0.0, {}
        self.maybe_flush()

    def req(self, rid: str, key: str, t: float, *, first: bool = True) -> None:
        with self.lock:
            r = self.reqs.setdefault(rid, {})
            if not first or key not in r:
                r[key] = t

    def finish_req(self, rid: str) -> None:
        with self.lock:
            r = self.reqs.pop(rid, None)
            if r is not None:
                r["fin"] = time.time()
                self.lines.append(json.dumps({"k": "req", "id": rid, **r}))

    def maybe_flush(self, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self.last_flush < 1.0:
            return
        with self.lock:
            lines, self.lines = self.lines, []
        self.last_flush = now
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")


def _timed(name: str, fn: Any, rec_of: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = rec_of(self)
        # Only the outermost wrapped call counts: the base class's
        # get_transfer_results calls get_finished, request_finished_all_groups
        # may call request_finished.
        depth = getattr(rec.depth, "n", 0)
        rec.depth.n = depth + 1
        q0 = _runqueue_wait() if _SLOW_S else 0.0
        c0 = time.thread_time()
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            dc = time.thread_time() - c0
            rec.depth.n = depth
            if depth == 0:
                rec.add(name, dt, dc)
                if _SLOW_S and dt >= _SLOW_S:
                    rec.slow(name, dt, dc, _runqueue_wait() - q0)
                if name == "build_connector_meta" or name == "bind_connector_metadata":
                    rec.end_step()

    return wrapper


def timed(base: type) -> type:
    """A subclass of connector class BASE with vLLM's per-step methods timed."""

    def rec_of(self: Any) -> _Recorder:
        return self._bench_rec

    ns: dict[str, Any] = {}
    for name in SCHEDULER_METHODS + WORKER_METHODS:
        fn = getattr(base, name, None)
        if callable(fn):
            ns[name] = _timed(name, fn, rec_of)

    def __init__(self: Any, vllm_config: Any, role: KVConnectorRole, *args: Any, **kwargs: Any) -> None:
        self._bench_rec = _Recorder("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        base.__init__(self, vllm_config, role, *args, **kwargs)

    inner_matched = ns["get_num_new_matched_tokens"]

    def get_num_new_matched_tokens(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        now = time.time()
        self._bench_rec.req(request.request_id, "seen", now)
        self._bench_rec.req(request.request_id, "arr", float(getattr(request, "arrival_time", now)))
        return inner_matched(self, request, *args, **kwargs)

    inner_output = ns["update_connector_output"]

    def update_connector_output(self: Any, connector_output: Any) -> Any:
        out = inner_output(self, connector_output)
        now = time.time()
        for rid in connector_output.finished_recving or ():
            self._bench_rec.req(rid, "ready", now)
        return out

    def finishing(inner: Any) -> Any:
        @functools.wraps(inner)
        def f(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            out = inner(self, request, *args, **kwargs)
            self._bench_rec.finish_req(request.request_id)
            return out

        return f

    def shutdown(self: Any) -> Any:
        self._bench_rec.maybe_flush(force=True)
        return base.shutdown(self)

    ns.update(
        __init__=__init__,
        get_num_new_matched_tokens=get_num_new_matched_tokens,
        update_connector_output=update_connector_output,
        request_finished=finishing(ns["request_finished"]),
        request_finished_all_groups=finishing(ns["request_finished_all_groups"]),
        shutdown=shutdown,
        __module__=__name__,
        __qualname__="Timed" + base.__name__,
    )
    return type("Timed" + base.__name__, (base,), ns)


TimedNixlConnector = timed(NixlConnector)
TimedNixlPushConnector = timed(NixlPushConnector)
TimedGoNixlConnector = timed(GoNixlConnector)
TimedGoNixlPushConnector = timed(GoNixlPushConnector)
