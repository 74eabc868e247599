#!/usr/bin/env bash
# The GPU data-path test, one command on a GPU host (tests/gpu/README.md):
#   bash tests/gpu/run.sh [kv_transfer.py arguments]
# Uses the UCX that ./build.sh gpu-bundle unpacked into .gpu/ when the host
# has none, and keeps NVLink multicast off in every process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
U="$PWD/.gpu/ucx/usr/lib/x86_64-linux-gnu"
if [ -e "$U/libucp.so.0" ] && [ -z "${GONIXL_UCX_LIB:-}" ]; then
  export LD_LIBRARY_PATH="$U${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" GONIXL_UCX_LIB="$U/libucp.so.0"
fi
export GONIXL_LOG_LEVEL="${GONIXL_LOG_LEVEL:-warn}" UCX_WARN_UNUSED_ENV_VARS=n
exec python3 tests/gpu/kv_transfer.py "$@"
