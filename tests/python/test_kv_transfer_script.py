"""tests/gpu/kv_transfer.py, the GPU data-path test, run on this machine's
CPUs: the same two processes, gonixl.engine calls and byte-for-byte checks
over DRAM through the real UCX engine, so that the script the GPU host runs
is exercised in every CI run. The CUDA run itself needs a GPU
(tests/gpu/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "gpu", "kv_transfer.py")


def test_kv_transfer_script_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--layers", "3", "--heads", "2", "--head-dim", "64",
         "--blocks", "96", "--read", "24", "--also-read", "95", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "PASS" in p.stdout
    import json

    r = json.loads(out.read_text())
    assert r["direct-24"]["descriptors"] == 24 * 3 * 2
    # 95 blocks: every usable block of the cache, read in one request.
    assert r["direct-95"]["bytes"] == 95 * 3 * 2 * 2 * 16 * 64 * 2
    assert len(r["direct-95"]["read_s_all"]) == 2


def test_kv_transfer_script_skips_without_gpu():
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is visible here: the skip path is for hosts without one")
    p = subprocess.run([sys.executable, SCRIPT, "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("SKIP: no CUDA device"), p.stdout + p.stderr


def test_host_staging_copies_exactly_the_blocks():
    """HostStaging's copies on CPU tensors (the index logic the GPU run
    uses): the chosen blocks of every layer, K and V, both directions,
    through permuted (HND) views; nothing else."""
    import torch

    from gonixl.engine import HostStaging

    nb = 10
    phys = [torch.randn(2, nb, 4, 16, 8) for _ in range(3)]
    views = {f"l{i}": p.permute(0, 1, 3, 2, 4) for i, p in enumerate(phys)}
    st = HostStaging(views, nb)
    for name, h in st.host_caches.items():
        assert h.shape == views[name].shape and h.stride() == views[name].stride()
        h.zero_()
    st.save_to_host([3, 7])
    for name, v in views.items():
        h = st.host_caches[name]
        assert torch.equal(h[:, [3, 7]], v[:, [3, 7]])
        assert torch.count_nonzero(h[:, [0, 1, 2, 4, 5, 6, 8, 9]]) == 0
    before = {n: v.clone() for n, v in views.items()}
    for h in st.host_caches.values():
        h[:, 5].fill_(1.5)
    st.load_to_device([5])
    for name, v in views.items():
        assert torch.all(v[:, 5] == 1.5)
        others = [b for b in range(nb) if b != 5]
        assert torch.equal(v[:, others], before[name][:, others])
