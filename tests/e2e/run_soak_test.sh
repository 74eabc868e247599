#!/usr/bin/env bash
# Soak test with leak accounting: a prefill vLLM (kv_producer) and a decode
# vLLM (kv_consumer) with GoNixlConnector (a short kv_lease_duration, gonixl's
# metrics server on GONIXL_METRICS_PORT), gonixl-proxy (toy mode) in front,
# and an aggregated vLLM without a connector as the baseline, all on this
# machine with the tiny fixture model; then tests/e2e/soak.py drives the
# load (streaming and not, clients that disconnect mid-stream, requests
# cancelled a moment after sending) and checks every response against the
# baseline and, at rest afterwards, that both engines hold nothing
# (transfer handles, leases, handshakes, scheduler state, KV-cache usage),
# that no background panic happened, and that goroutines and RSS are back
# near their post-warm-up values.
#
# Every process started here is stopped on exit, also on failure (lib.sh).
# Environment knobs:
#   GONIXL_SOAK_REQUESTS (default 2000; ./build.sh test runs 500)
#   GONIXL_SOAK_CONCURRENCY (default 32)
#   GONIXL_SOAK_LEASE (kv_lease_duration in seconds, default 10)
#   GONIXL_SOAK_POLICY (the decode's kv_load_failure_policy, default recompute)
#   GONIXL_SOAK_DEADLINE (a request's client deadline in seconds, default 120)
#   GONIXL_SOAK_DISCONNECT_FRAC, GONIXL_SOAK_ABORT_FRAC (default 0.05 each)
#   GONIXL_SOAK_EXECUTOR (mp, default: vLLM's CPU default, a worker process
#   of its own; uni: the worker in the scheduler's process)
#   GONIXL_SOAK_ONEDNN_CACHE (ONEDNN_PRIMITIVE_CACHE_CAPACITY of prefill and
#   decode, default 0; see below)
#   GONIXL_SOAK_SEED, GONIXL_SOAK_GOROUTINE_MARGIN (20),
#   GONIXL_SOAK_RSS_MARGIN_MIB / _PCT (RSS growth allowed: the larger of the two)
#   GONIXL_E2E_LOGS (log folder, default tests/e2e/logs/soak; the summary is
#   written to soak_summary.json there), GONIXL_E2E_TIMEOUT (seconds to wait
#   for the servers, default 600), GONIXL_E2E_ENGINE (transfer_engine: ucx,
#   nixl or auto; default ucx), GONIXL_E2E_MODEL.
set -euo pipefail

E2E_NAME=run_soak_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/tiny-copy-model}"
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/soak}"
rm -f "$LOGS/soak_summary.json"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"

P_PORT=$(free_port); D_PORT=$(free_port); X_PORT=$(free_port)
P_SIDE=$(free_port); D_SIDE=$(free_port); P_MET=$(free_port); D_MET=$(free_port)

ENGINE="${GONIXL_E2E_ENGINE:-ucx}"
LEASE="${GONIXL_SOAK_LEASE:-10}"
EXTRA="\"kv_lease_duration\":$LEASE"
# The decode's kv_load_failure_policy. recompute: a request whose short
# lease lapsed while it waited in a starved decode's queue (no heartbeat
# covers a request the scheduler has not looked at yet) is computed by the
# decode and must still be correct; soak.py fails on any other kind of
# transfer failure in the decode's log, and counts the lapses. The lease
# stays short so that the settle waits stay short.
POLICY="${GONIXL_SOAK_POLICY:-recompute}"
# Where vLLM runs the worker. uni: in the EngineCore process with the
# scheduler (vLLM's default for TP = PP = 1 on a GPU host; on the CPU
# platform it needs VLLM_ENABLE_V1_MULTIPROCESSING=0, which changes nothing
# else for the API server). mp: vLLM's CPU default, a worker process of its
# own, so scheduler and worker are two processes, each serving its own
# gonixl metrics port (worker: base, scheduler: base + 1).
EXECUTOR="${GONIXL_SOAK_EXECUTOR:-mp}"
case "$EXECUTOR" in
  uni) XENV=(VLLM_ENABLE_V1_MULTIPROCESSING=0) ;;
  mp) XENV=(VLLM_ENABLE_V1_MULTIPROCESSING=1) ;;
  *) e2e_say "GONIXL_SOAK_EXECUTOR=$EXECUTOR: want uni or mp"; exit 2 ;;
esac
# oneDNN (in vLLM's CPU GEMMs) caches a primitive per distinct batch shape,
# up to 1024 by default: with prompts of every length the engine's RSS grows
# for thousands of requests, with or without a connector (an aggregated vLLM
# without one grew 828 -> 1064 MiB over 2000 max_tokens=1 requests, and still
# +27 MiB over the last 500). Without that cache RSS is flat after the first
# few hundred requests, so the RSS check sees what gonixl holds.
XENV+=(ONEDNN_PRIMITIVE_CACHE_CAPACITY="${GONIXL_SOAK_ONEDNN_CACHE:-0}")
# --enable-log-requests: vLLM logs each request it aborts, so the soak can
# tell where the client's cancels landed (prefill or decode).
SAVED=("${COMMON[@]}")
COMMON+=(--enable-log-requests)
start_vllm prefill "$P_PORT" "$P_SIDE" "$(gonixl_kv_config_extra kv_producer "$ENGINE" "$EXTRA")" \
  GONIXL_METRICS_PORT="$P_MET" "${XENV[@]}"
start_vllm decode "$D_PORT" "$D_SIDE" "$(gonixl_kv_config_extra kv_consumer "$ENGINE" "$EXTRA" | sed "s/\"kv_role\":\"kv_consumer\"/&,\"kv_load_failure_policy\":\"$POLICY\"/")" \
  GONIXL_METRICS_PORT="$D_MET" "${XENV[@]}"
COMMON=("${SAVED[@]}")
e2e_baseline
start_proxy proxy "$X_PORT" "$P_PORT" "$D_PORT"

wait_ready proxy "http://127.0.0.1:$X_PORT/healthcheck"
wait_ready prefill "http://127.0.0.1:$P_PORT/health"
wait_ready decode "http://127.0.0.1:$D_PORT/health"
e2e_baseline_wait
# gonixl's metrics servers start with the engines (register_kv_caches, before
# vLLM is ready); with TP = PP = 1 worker and scheduler share one on exactly
# GONIXL_METRICS_PORT.
wait_log prefill "$LOGS/prefill.log" 'gonixl metrics served' >&2
wait_log decode "$LOGS/decode.log" 'gonixl metrics served' >&2
e2e_say "servers up after $(e2e_elapsed)s"

export GONIXL_E2E_PROXY="http://127.0.0.1:$X_PORT" GONIXL_E2E_BASELINE="$BASELINE_URL"
export GONIXL_E2E_PREFILL="http://127.0.0.1:$P_PORT" GONIXL_E2E_DECODE="http://127.0.0.1:$D_PORT"
export GONIXL_E2E_DECODE_LOG="$LOGS/decode.log" GONIXL_E2E_PREFILL_LOG="$LOGS/prefill.log" GONIXL_E2E_MODEL="$MODEL"
export GONIXL_SOAK_PREFILL_METRICS="http://127.0.0.1:$P_MET" GONIXL_SOAK_DECODE_METRICS="http://127.0.0.1:$D_MET"
export GONIXL_SOAK_LEASE="$LEASE" GONIXL_SOAK_SUMMARY="$LOGS/soak_summary.json"
"$PY" "$ROOT/tests/e2e/soak.py"
e2e_say "passed in $(e2e_elapsed)s"
