#!/usr/bin/env bash
# End-to-end accuracy test: a prefill vLLM (kv_producer) and a decode vLLM
# (kv_consumer) with GoNixlConnector behind gonixl-proxy (toy mode), and an
# aggregated vLLM without any connector as the baseline, all on this
# machine with the tiny fixture model; then tests/e2e/test_accuracy.py.
#
# Every process started here is stopped on exit, also on failure (lib.sh).
# Environment knobs: GONIXL_E2E_LOGS (log folder), GONIXL_E2E_TIMEOUT
# (seconds to wait for the servers, default 600), GONIXL_E2E_ENGINE
# (transfer_engine: ucx, nixl or auto; default ucx), GONIXL_E2E_MODEL,
# GONIXL_E2E_DECODE_BLOCK_SIZE (the decode's --block-size, a multiple of the
# prefill's 32: the decode then reads each of its blocks as several of the
# prefill's), GONIXL_E2E_LEASE (kv_lease_duration, default 120 s).
set -euo pipefail

E2E_NAME=run_accuracy_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/tiny-copy-model}"
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs}"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"

P_PORT=$(free_port); D_PORT=$(free_port); X_PORT=$(free_port)
P_SIDE=$(free_port); D_SIDE=$(free_port)

# The transfer engine: gonixl's UCX engine by default; GONIXL_E2E_ENGINE=nixl
# (or auto) runs NIXL. NIXL's progress thread used to spin a core per worker
# here and stall decodes ~30 s; gonixl now gives it a 1 ms delay
# (progress_thread_delay_us, docs/ENVIRONMENT.md).
ENGINE="${GONIXL_E2E_ENGINE:-ucx}"
# The prefill's lease: long enough that a request waiting in a starved
# decode's queue still finds its KV (the fault suite tests lapsed leases).
EXTRA="\"kv_lease_duration\":${GONIXL_E2E_LEASE:-120}"
start_vllm prefill "$P_PORT" "$P_SIDE" "$(gonixl_kv_config_extra kv_producer "$ENGINE" "$EXTRA")"
SAVED=("${COMMON[@]}")
[ -n "${GONIXL_E2E_DECODE_BLOCK_SIZE:-}" ] && COMMON+=(--block-size "$GONIXL_E2E_DECODE_BLOCK_SIZE")
start_vllm decode "$D_PORT" "$D_SIDE" "$(gonixl_kv_config_extra kv_consumer "$ENGINE" "$EXTRA")"
COMMON=("${SAVED[@]}")
e2e_baseline
start_proxy proxy "$X_PORT" "$P_PORT" "$D_PORT"

wait_ready proxy "http://127.0.0.1:$X_PORT/healthcheck"
wait_ready prefill "http://127.0.0.1:$P_PORT/health"
wait_ready decode "http://127.0.0.1:$D_PORT/health"
e2e_baseline_wait

export GONIXL_E2E_PROXY="http://127.0.0.1:$X_PORT" GONIXL_E2E_BASELINE="$BASELINE_URL"
export GONIXL_E2E_PREFILL="http://127.0.0.1:$P_PORT" GONIXL_E2E_DECODE="http://127.0.0.1:$D_PORT"
export GONIXL_E2E_DECODE_LOG="$LOGS/decode.log" GONIXL_E2E_PREFILL_LOG="$LOGS/prefill.log" GONIXL_E2E_MODEL="$MODEL"
e2e_pytest "$PY" -m pytest -q -rA -p no:cacheprovider "$ROOT/tests/e2e/test_accuracy.py"
