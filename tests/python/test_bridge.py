"""The Python bridge against the real libgonixl.so: loading, ABI, status
mapping, and bad input at the C boundary (clear errors, never a crash)."""

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

import gonixl
from gonixl import _lib, errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=60)


def cfg(role="scheduler", **kw) -> bytes:
    c = {"role": role, "kv_role": "kv_producer", "engine_id": "engine-a"}
    c.update(kw)
    return json.dumps(c).encode()


def new_handle(fn: str, config: bytes) -> int:
    h = _lib.handle_t()
    _lib.call(fn, config, len(config), ctypes.byref(h))
    return h.value


def test_import_does_not_load_library():
    r = run_py(
        """
        import gonixl, gonixl._lib, sys
        assert not gonixl._lib.is_loaded(), "library loaded at import"
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_version_and_abi(lib_path):
    assert gonixl.abi_version() == _lib.ABI_VERSION
    v = gonixl.library_version()
    assert v and v[0].isdigit(), v


def test_probe_reports_engines():
    info = gonixl.probe()
    assert info["version"] == gonixl.library_version()
    assert info["go_version"].startswith("go")
    assert isinstance(info["engines"], list)
    for e in info["engines"]:
        assert e["available"] or e["reason"], e


def test_missing_library_is_clear_error(tmp_path):
    r = run_py(
        """
        import gonixl
        try:
            gonixl.library_version()
        except gonixl.LibraryLoadError as e:
            print("LoadError:", e)
        """,
        {"GONIXL_LIB_PATH": str(tmp_path / "nope.so")},
    )
    assert r.returncode == 0, r.stderr
    assert "LoadError:" in r.stdout and "nope.so" in r.stdout


def test_not_a_library_is_clear_error(tmp_path):
    bad = tmp_path / "libgonixl.so"
    bad.write_bytes(b"not an ELF file")
    r = run_py(
        """
        import gonixl
        try:
            gonixl.library_version()
        except gonixl.LibraryLoadError as e:
            print("LoadError:", e)
        """,
        {"GONIXL_LIB_PATH": str(bad)},
    )
    assert r.returncode == 0, r.stderr
    assert "cannot load" in r.stdout


def test_handles_lifecycle_and_stale_handle():
    h = new_handle("gonixl_scheduler_new", cfg())
    assert h != 0
    _lib.call("gonixl_scheduler_close", h)
    with pytest.raises(errors.InvalidHandleError) as ei:
        _lib.call("gonixl_scheduler_close", h)
    assert ei.value.status == errors.ERR_INVALID_HANDLE
    assert "unknown or already closed" in str(ei.value)


def test_zero_and_garbage_handles():
    with pytest.raises(errors.InvalidHandleError, match="is 0"):
        _lib.call("gonixl_worker_close", 0)
    with pytest.raises(errors.InvalidHandleError):
        _lib.call("gonixl_worker_close", 12345)  # looks like an fd, never a handle


def test_wrong_kind_handle():
    h = new_handle("gonixl_scheduler_new", cfg())
    try:
        with pytest.raises(errors.InvalidHandleError) as ei:
            _lib.call("gonixl_worker_close", h)
        assert ei.value.status == errors.ERR_WRONG_HANDLE
        assert "scheduler handle, expected a worker handle" in str(ei.value)
    finally:
        _lib.call("gonixl_scheduler_close", h)


def test_worker_handle_and_role_check():
    h = new_handle("gonixl_worker_new", cfg(role="worker", kv_role="kv_consumer"))
    _lib.call("gonixl_worker_close", h)
    with pytest.raises(errors.InvalidArgumentError, match="role"):
        new_handle("gonixl_worker_new", cfg(role="scheduler"))


@pytest.mark.parametrize(
    "config, fragment",
    [
        (b"{not json", "invalid JSON"),
        (b"", "invalid JSON"),
        (json.dumps({"role": "scheduler", "kv_role": "kv_producer"}).encode(), "engine_id is required"),
        (cfg(kv_role="kv_sideways"), "kv_role"),
        (cfg(kv_connector_extra_config={"kv_lease_duration": "soon"}), "kv_lease_duration"),
        (cfg(kv_connector_extra_config={"backends": [1]}), "backends"),
        (cfg(kv_load_failure_policy="ignore"), "kv_load_failure_policy"),
        (cfg(kv_connector_extra_config={"transfer_engine": "rdma-magic"}), "transfer_engine"),
    ],
)
def test_bad_config_is_invalid_argument(config, fragment):
    with pytest.raises(errors.InvalidArgumentError) as ei:
        new_handle("gonixl_scheduler_new", config)
    assert fragment in str(ei.value)
    assert str(ei.value).startswith("[gonixl] ")


def test_null_pointers():
    lib = _lib.lib()
    err = _lib.Error()
    h = _lib.handle_t()
    # NULL config with a non-zero length
    st = lib.gonixl_scheduler_new(None, 10, ctypes.byref(h), ctypes.byref(err))
    assert st == errors.ERR_NULL_POINTER and b"NULL" in err.message
    # NULL out pointer
    c = cfg()
    st = lib.gonixl_scheduler_new(c, len(c), None, ctypes.byref(err))
    assert st == errors.ERR_NULL_POINTER
    # NULL len pointer
    st = lib.gonixl_version(None, None, ctypes.byref(err))
    assert st == errors.ERR_NULL_POINTER
    # NULL error struct is allowed
    assert lib.gonixl_scheduler_new(None, 10, ctypes.byref(h), None) == errors.ERR_NULL_POINTER


def test_buffer_size_negotiation():
    lib = _lib.lib()
    err = _lib.Error()
    n = ctypes.c_size_t(0)
    st = lib.gonixl_version(None, ctypes.byref(n), ctypes.byref(err))
    assert st == errors.ERR_BUFFER_TOO_SMALL
    need = n.value
    assert need == len(gonixl.library_version())
    small = ctypes.create_string_buffer(1)
    n2 = ctypes.c_size_t(1)
    if need > 1:
        st = lib.gonixl_version(small, ctypes.byref(n2), ctypes.byref(err))
        assert st == errors.ERR_BUFFER_TOO_SMALL and n2.value == need
        assert b"too small" in err.message
    buf = ctypes.create_string_buffer(need)
    n3 = ctypes.c_size_t(need)
    assert lib.gonixl_version(buf, ctypes.byref(n3), ctypes.byref(err)) == errors.OK
    assert buf.raw[: n3.value].decode() == gonixl.library_version()


def test_debug_panic_disabled_without_hook():
    with pytest.raises(errors.NotSupportedError, match="GONIXL_TEST_HOOKS"):
        _lib.call("gonixl_debug_panic")
    # the library is not poisoned by the refused call
    assert gonixl.library_version()


def test_panic_poisons_library_in_subprocess():
    r = run_py(
        """
        import gonixl
        from gonixl import _lib, errors
        try:
            _lib.call("gonixl_debug_panic")
        except errors.InternalError as e:
            print("internal:", e)
        try:
            gonixl.library_version()
        except errors.PoisonedError as e:
            print("poisoned:", e)
        """,
        {"GONIXL_TEST_HOOKS": "1"},
    )
    assert r.returncode == 0, r.stderr
    assert "internal: [gonixl] Go panic" in r.stdout
    assert "poisoned: [gonixl] library is poisoned" in r.stdout
    assert "Go panic, library poisoned" in r.stderr  # the stack goes to stderr once


@pytest.mark.parametrize("how", ["started-with", "set-in-python"])
def test_environment_seen_after_setproctitle(how):
    # vLLM's EngineCore and workers call setproctitle, which overwrites the
    # process's original environment block, before gonixl loads; Python
    # code may also set variables before the load. The library must see
    # the live environment in both cases (GONIXL_TEST_HOOKS is read once at
    # load, and enables the panic hook).
    r = run_py(
        """
        import os, sys, setproctitle
        setproctitle.setproctitle("VLLM::Worker")
        if sys.argv[-1] == "set-in-python":
            os.environ["GONIXL_TEST_HOOKS"] = "1"
        from gonixl import _lib, errors
        try:
            _lib.call("gonixl_debug_panic")
        except errors.InternalError as e:
            print("hook enabled")
        except errors.NotSupportedError as e:
            print("hook disabled:", e)
        """.replace("sys.argv[-1]", repr(how)),
        {"GONIXL_TEST_HOOKS": "1"} if how == "started-with" else {"GONIXL_TEST_HOOKS": ""},
    )
    assert r.returncode == 0, r.stderr
    assert "hook enabled" in r.stdout, r.stdout


def test_use_after_fork_is_refused():
    r = run_py(
        """
        import os, gonixl
        from gonixl import errors
        gonixl.library_version()
        pid = os.fork()
        if pid == 0:
            try:
                gonixl.library_version()
                os._exit(3)
            except errors.LibraryLoadError as e:
                os._exit(0 if "fork" in str(e) else 4)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "child 0"


def test_abi_check_detects_mismatch(tmp_path, lib_path):
    header = open(os.path.join(ROOT, "include", "gonixl.h")).read()
    bad = header.replace(
        "gonixl_status_t gonixl_debug_panic(gonixl_error_t *err);",
        "gonixl_status_t gonixl_debug_panic(gonixl_error_t *err);\ngonixl_status_t gonixl_not_there(gonixl_error_t *err);",
    )
    assert bad != header
    p = tmp_path / "gonixl.h"
    p.write_text(bad)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "abi_check.py"), lib_path, str(p)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "gonixl_not_there" in r.stdout


def _dummy_args(argtypes):
    """Arguments of the right C types after the handle: empty buffers,
    zero lengths and counts, valid out-pointers."""
    args = []
    for t in argtypes[1:-1]:  # skip the handle and the trailing error struct
        if t is ctypes.c_char_p:
            args.append(ctypes.create_string_buffer(64))
        elif t is _lib.size_p:
            args.append(ctypes.byref(ctypes.c_size_t(64)))
        elif t is _lib.i64_p:
            args.append((ctypes.c_int64 * 1)(0))
        elif t is _lib.i32_p:
            args.append(ctypes.byref(ctypes.c_int32(0)))
        elif t is _lib.f64_p:
            args.append(ctypes.byref(ctypes.c_double(0.0)))
        elif t is _lib.u8_p:
            args.append((ctypes.c_uint8 * 1)(0))
        elif t is _lib.worker_state_pp:
            args.append(ctypes.byref(ctypes.POINTER(_lib.WorkerState)()))
        else:
            args.append(0)
    return args


HANDLE_FUNCTIONS = [p for p in _lib.PROTOTYPES if p[2] and p[2][0] is _lib.handle_t]


@pytest.mark.parametrize("name,restype,argtypes", HANDLE_FUNCTIONS, ids=[p[0] for p in HANDLE_FUNCTIONS])
def test_every_handle_function_rejects_bad_handles(name, restype, argtypes):
    """Every export that takes a handle answers a closed, a zero and a
    wrong-kind handle with an error -- through its own code path."""
    sched = new_handle("gonixl_scheduler_new", cfg())
    work = new_handle("gonixl_worker_new", cfg(role="worker", kv_role="kv_consumer"))
    _lib.call("gonixl_scheduler_close", sched)
    _lib.call("gonixl_worker_close", work)
    lib = _lib.lib()
    wrong = work if "scheduler" in name else sched
    for h, want in ((0, errors.ERR_INVALID_HANDLE), (sched if "scheduler" in name else work, errors.ERR_INVALID_HANDLE), (wrong, errors.ERR_WRONG_HANDLE)):
        err = _lib.Error()
        st = getattr(lib, name)(h, *_dummy_args(argtypes), ctypes.byref(err))
        assert st == want, f"{name}({h:#x}) returned {st}: {err.message!r}"
    assert gonixl.library_version()  # not poisoned


def test_hot_calls_keep_the_gil():
    # Per-step calls go through ctypes.PyDLL (the GIL stays held: taking it
    # back after a CDLL call waits for vLLM's other threads); the rest
    # through CDLL, which releases it for calls that may take long.
    _lib.lib()
    names = {p[0] for p in _lib.PROTOTYPES}
    assert _lib.HOT <= names, _lib.HOT - names
    for name in _lib.HOT:
        assert _lib._hot[name]._flags_ & ctypes._FUNCFLAG_PYTHONAPI, name
    for name in ("gonixl_worker_register_kv_caches", "gonixl_scheduler_new", "gonixl_worker_close"):
        assert name not in _lib.HOT
        assert not getattr(_lib.lib(), name)._flags_ & ctypes._FUNCFLAG_PYTHONAPI, name


def test_one_binding_of_the_c_abi():
    """Every call into the library goes through gonixl.engine's Scheduler,
    Worker and module functions (one binding, one error mapping): no other
    module of the package calls _lib.call or _lib.call_bytes, and every C
    function the ctypes prototypes declare is called from the binding."""
    import ast

    pkg = os.path.join(ROOT, "pybridge", "gonixl")
    called: set[str] = set()
    for name in sorted(os.listdir(pkg)):
        if not name.endswith(".py") or name == "_lib.py":
            continue
        tree = ast.parse(open(os.path.join(pkg, name)).read())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("call", "call_bytes", "call_into")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "_lib"
            ):
                assert name == "engine.py", f"{name}:{node.lineno} calls the library directly; go through gonixl.engine"
            if isinstance(node, ast.Call) and name == "engine.py":
                # _lib.call("gonixl_...", ...), _new("gonixl_..._new", ...),
                # _lib.call_into(buffer, "gonixl_...", ...)
                for a in node.args[:2]:
                    if isinstance(a, ast.Constant) and isinstance(a.value, str):
                        called.add(a.value)
    declared = {p[0] for p in _lib.PROTOTYPES} - {"gonixl_abi_version", "gonixl_debug_panic"}
    assert declared <= called, f"C functions without a binding method: {sorted(declared - called)}"


def test_scheduler_batch_refuses_a_bad_op_alone():
    """The binding's scheduler batch (include/gonixl.h "Scheduler batches"):
    an op the library cannot decode is refused alone (its result
    OP_INVALID), the ops around it applied; a batch whose framing does not
    hold raises, applies nothing and runs no callback."""
    from gonixl import engine

    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r1", "remote_host": "127.0.0.1",
              "remote_port": 5999, "remote_block_ids": [[1, 2]], "tp_size": 1}
    s = engine.Scheduler(cfg(kv_role="kv_consumer", engine_id="engine-batch"))
    try:
        got: list[int] = []
        s.on_new_request("d1", params)
        s._queue(9, b"not an op", got.append)
        s.update_state_after_alloc_later("d1", params, [[3, 4]], [0], 64, lambda m: got.append(100 + m))
        assert s.pending_ops == 3
        s.flush()
        assert got == [engine.OP_INVALID, 101], got
        assert s.pending_ops == 0
        live = s.live()
        assert live["heartbeat_leases"] == 1 and live["awaiting_kv"] == 1, live
        # Framing: an op that claims more bytes than the batch holds.
        got.clear()
        s.on_new_request("d2", {**params, "remote_request_id": "r2"})
        s._ops += b"\x01\xff\x00\x00\x00"
        s._then.append(got.append)
        with pytest.raises(errors.InvalidArgumentError):
            s.flush()
        assert got == [] and s.pending_ops == 0
        assert s.live()["heartbeat_leases"] == 1, "the refused batch was applied"
    finally:
        s.close()


@pytest.mark.parametrize(
    "groups",
    [None, (), ([],), ([5, 1, 9],), ((7,),), [[1, 2], [3]], ([], [4, 4]), (range(3), [8])],
)
def test_flatten_groups_flat_ids_and_lengths(groups):
    """The arrays request_finished and update_state_after_alloc hand the
    library: every group's ids in order, and each group's length (one
    group takes a path of its own)."""
    from gonixl.engine import flatten_groups

    ids, n, lens, ng = flatten_groups(groups)
    lists = [list(g) for g in (groups or ())]
    assert (list(ids), n) == ([b for g in lists for b in g], sum(map(len, lists)))
    assert (list(lens), ng) == ([len(g) for g in lists], len(lists))
