"""Checks an installed gonixl wheel; tests/wheel/test_wheel.sh runs it with
the python of the scratch venv the wheel was installed into:

    python tests/wheel/check_wheel.py WHEEL

1. The package, its metadata and libgonixl.so come from that venv and from
   WHEEL (same tag, same library bytes): the library is found inside the
   package (GONIXL_LIB_PATH is unset) and is the file this process maps.
2. Two GoNixlConnector pairs built from the wheel -- a prefill and a decode
   instance, vLLM's real config and KV-cache objects, the real side channel
   on 127.0.0.1 and the UCX transfer engine -- move one prompt's KV blocks,
   and the decode's KV cache then holds the prefill's bytes. This is the
   flow of tests/python/test_connector.py, through its harness.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import time
import zipfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"check_wheel [{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def inside(path: str, root: str) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_installed(wheel: str) -> dict:
    venv = sys.prefix
    assert venv != sys.base_prefix, f"not running in a venv: {sys.executable}"
    assert "GONIXL_LIB_PATH" not in os.environ, "GONIXL_LIB_PATH must be unset: the package must find its own library"

    import gonixl
    from gonixl import _lib

    assert inside(gonixl.__file__, venv), f"gonixl imported from {gonixl.__file__}, not from the wheel in {venv}"
    dist = importlib.metadata.distribution("gonixl")
    recorded = {str(f) for f in dist.files or ()}
    assert "gonixl/libgonixl.so" in recorded, f"the wheel's RECORD has no gonixl/libgonixl.so: {sorted(recorded)}"
    assert inside(str(dist.locate_file("gonixl/libgonixl.so")), venv)
    # The installed distribution is WHEEL: its tag (from the file name) and
    # its library.
    tag = os.path.basename(wheel)[: -len(".whl")].split("-", 2)[2]
    installed_tags = [ln.split(":", 1)[1].strip() for ln in (dist.read_text("WHEEL") or "").splitlines() if ln.startswith("Tag:")]
    assert installed_tags == [tag], f"installed wheel tags {installed_tags}, {os.path.basename(wheel)} has {tag}"
    with zipfile.ZipFile(wheel) as z:
        want = sha256(z.read("gonixl/libgonixl.so"))

    info = gonixl.probe()  # loads the library
    loaded = _lib._path
    assert loaded is not None and inside(loaded, venv), f"libgonixl.so loaded from {loaded}, not from {venv}"
    assert os.path.samefile(loaded, os.path.join(os.path.dirname(gonixl.__file__), "libgonixl.so"))
    with open("/proc/self/maps") as f:
        mapped = {line.split(None, 5)[5].strip() for line in f if line.rstrip().endswith("libgonixl.so")}
    assert mapped == {os.path.realpath(loaded)}, f"mapped copies of libgonixl.so: {mapped}"
    with open(loaded, "rb") as f:
        assert sha256(f.read()) == want, f"{loaded} is not the library inside {wheel}"
    assert info["version"] == dist.version, f"library version {info['version']}, wheel version {dist.version}"
    say(f"gonixl {dist.version} from {os.path.dirname(gonixl.__file__)}; library mapped from {loaded}")
    return info


def check_transfer(info: dict) -> None:
    # UCX is installed wherever the wheel is checked (./build.sh setup): an
    # engine that does not load is a failure, never a skipped transfer.
    ucx = next((e for e in info["engines"] if e["name"] == "ucx"), None)
    if ucx is None or not ucx["available"]:
        why = "not built into the library" if ucx is None else ucx.get("reason") or "not available"
        raise SystemExit(f"check_wheel: FAILED: gonixl's UCX transfer engine from the wheel does not load: {why}")

    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import connector_harness as h  # imports vLLM (several seconds)
    import torch
    from vllm.distributed import parallel_state as ps
    from vllm.v1.request import RequestStatus

    from gonixl.vllm import GoNixlConnector

    assert inside(sys.modules[GoNixlConnector.__module__].__file__ or "", sys.prefix)
    say("vLLM imported")

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
    engines: list[h.Engine] = []
    try:
        p = h.Engine(GoNixlConnector, "kv_producer", "wheel-prefill", 16)
        engines.append(p)
        d = h.Engine(GoNixlConnector, "kv_consumer", "wheel-decode", 24)
        engines.append(d)
        p.fill_all(-7.0)
        d.fill_all(-3.0)
        say("prefill and decode connectors up")

        num_tokens = 3 * h.BLOCK_SIZE + 5
        pre = h.prefill(p, "wheel-p", num_tokens, seed=11)
        assert pre.delay is True
        dr = h.schedule_decode(d, "wheel-d", num_tokens, pre.params)
        assert (dr.n_ext, dr.load_async) == (num_tokens, True), (dr.n_ext, dr.load_async)
        pid, did = pre.req.request_id, dr.req.request_id
        h.run_until([p, d], lambda: did in d.out.recving and pid in p.out.sending, "the transfer to finish")
        assert did not in d.out.failed and not d.out.invalid_blocks
        for name in h.layer_names(d.vllm_config):
            for s, t in zip(pre.block_ids, dr.new_blocks, strict=True):
                assert torch.equal(d.block(name, t), p.block(name, s)), f"{name}: decode block {t} != prefill block {s}"
        dr.req.status = RequestStatus.FINISHED_STOPPED
        assert d.sched.request_finished(dr.req, dr.new_blocks) == (False, None)
        say(f"{len(pre.block_ids)} KV blocks of every layer moved prefill -> decode over UCX, bytes equal")
    finally:
        for e in engines:
            e.shutdown()
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: check_wheel.py WHEEL")
    info = check_installed(sys.argv[1])
    check_transfer(info)
    say("OK")


if __name__ == "__main__":
    main()
