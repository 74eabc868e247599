"""The vLLM connector asks Linux for AMX tile-data permission in worker processes.

vLLM's bfloat16 CPU attention executes AMX tile instructions without asking
for the permission (arch_prctl ARCH_REQ_XCOMP_PERM); a decode worker whose
first forward follows a KV transfer dies with SIGILL unless someone asked
first. Each check runs in a fresh interpreter, because the permission is
process-wide and cannot be dropped once granted.

Run: .venv/bin/python -m pytest -q tests/python/test_amx_permission.py
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import platform
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

if sys.platform != "linux" or platform.machine() != "x86_64":  # pragma: no cover - environment
    pytest.skip(f"AMX permission is Linux x86_64 only (this is {sys.platform}/{platform.machine()})", allow_module_level=True)
if importlib.util.find_spec("vllm") is None:  # pragma: no cover - environment
    pytest.skip("vLLM is not installed in this interpreter (use .venv/bin/python)", allow_module_level=True)

CHILD = textwrap.dedent(
    """
    import ctypes, json, torch
    libc = ctypes.CDLL(None, use_errno=True)

    def perm():
        mask = ctypes.c_uint64()
        rc = libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1022), ctypes.byref(mask))  # ARCH_GET_XCOMP_PERM
        assert rc == 0, ctypes.get_errno()
        return mask.value

    amx = bool(torch.cpu._is_amx_tile_supported())
    before = perm()
    import gonixl.vllm
    gonixl.vllm._request_amx_tile_permission()
    print(json.dumps({"amx": amx, "before": before, "after": perm()}))
    """
)

XTILEDATA = 1 << 18


def run_child() -> dict:
    import json

    env = dict(os.environ, PYTHONPATH=str(ROOT / "pybridge") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("HF_HUB_OFFLINE", "1")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_worker_helper_grants_xtiledata():
    got = run_child()
    if not got["amx"]:
        pytest.skip("this CPU has no AMX tiles (torch.cpu._is_amx_tile_supported() is False)")
    assert not got["before"] & XTILEDATA, f"a fresh interpreter already had AMX permission: {got['before']:#x}"
    assert got["after"] & XTILEDATA, f"permission mask after the request: {got['after']:#x}"


def test_worker_role_requests_before_loading_library():
    # The request must precede the library load: once Go and UCX threads
    # exist, the kernel validates their signal stacks as well.
    import ast

    src = (ROOT / "pybridge" / "gonixl" / "vllm.py").read_text()
    init = next(
        n
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.FunctionDef) and n.name == "__init__" and "KVConnectorRole.WORKER" in ast.unparse(n)
    )
    body = ast.unparse(init)
    assert "_request_amx_tile_permission()" in body
    assert body.index("_request_amx_tile_permission()") < body.index("Worker(")
