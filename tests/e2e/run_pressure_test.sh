#!/usr/bin/env bash
# KV-cache pressure and preemption, end to end, with async scheduling on:
# for each configuration MODE:PREFILL-DECODE (MODE pull or push; each side
# "go", gonixl's GoNixlConnector / GoNixlPushConnector, or "stock", vLLM's
# NixlConnector / NixlPushConnector with host buffers), a prefill and a
# decode vLLM whose KV pools are small enough that both preempt under the
# load (--num-gpu-blocks-override), chunked prefill on the prefill
# (--enable-chunked-prefill, --max-num-batched-tokens well below the prompt
# lengths), gonixl-proxy in front (--push in push mode); one aggregated vLLM
# without a connector is the baseline for every configuration. Then
# tests/e2e/test_pressure.py: long outputs, prompts sharing prefixes, other
# traffic straight at the prefill, clients that abandon their requests after
# 0.2 s, then fresh requests; every completed output equals the baseline's,
# every request ends within its bound, vllm:num_preemptions_total grew on
# the prefill and on the decode, and afterwards every live gauge (gonixl's
# and vLLM's KV usage, running, waiting) is zero.
#
# Every instance runs with GONIXL_TEST_ASYNC_SCHEDULING=1 and the test plugin
# tests/vllm_async_plugin installed in .venv (./build.sh build installs it),
# which keeps vLLM's CPU platform from turning async scheduling off, as it is
# on GPUs; the test checks each instance's log for the plugin's proof lines.
#
# The configurations run one after another against the one baseline; each
# pair is stopped before the next starts, so at most three vLLMs are alive.
# Every process is stopped on exit, also on failure (lib.sh), and the last
# lines of each log are printed when a run fails.
#
# Environment knobs (besides test_pressure.py's GONIXL_PRESSURE_REQUESTS,
# _DIRECT, _DIRECT_CONCURRENCY, _ABANDON, _ABANDON_AFTER, _FRESH, _PAUSE, _CONCURRENCY, _MAX_TOKENS,
# _DEADLINE, _SETTLE_MARGIN, _SEED):
#   GONIXL_PRESSURE_CONFIGS  comma list of MODE:PREFILL-DECODE (default
#                            pull:go-go,push:go-go; a stock side needs the other to be go)
#   GONIXL_PRESSURE_ENGINE   transfer_engine of gonixl instances facing gonixl (ucx);
#                            facing a stock peer it is always nixl
#   GONIXL_PRESSURE_PREFILL_BLOCKS, GONIXL_PRESSURE_DECODE_BLOCKS
#                            KV blocks of the prefill and the decode (48, 48; at
#                            least max_model_len / block size = 32)
#   GONIXL_PRESSURE_CHUNK    the prefill's --max-num-batched-tokens (64)
#   GONIXL_PRESSURE_LEASE    kv_lease_duration of every connector instance (120 s: a
#                            starved two-core host delays registrations and
#                            heartbeats by tens of seconds; a hold whose decode
#                            never got its request, its client gone in between,
#                            lasts until the lease, and the at-rest check waits)
#   GONIXL_E2E_MODEL         model folder (default tests/fixtures/geometry/llama-28l-gqa)
#   GONIXL_E2E_LOGS          log folder (default tests/e2e/logs/pressure; the summaries
#                            go to pressure_summary.jsonl there)
#   GONIXL_E2E_TIMEOUT       seconds to wait for the servers (600)
#   GONIXL_LOG_LEVEL         gonixl's log level in the instances (info; debug to diagnose)
set -euo pipefail

E2E_NAME=run_pressure_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/geometry/llama-28l-gqa}"
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/pressure}"
rm -f "$LOGS/pressure_summary.jsonl"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
export GONIXL_TEST_ASYNC_SCHEDULING=1
"$PY" -c 'import gonixl_async_plugin' 2>/dev/null || {
  e2e_say "the async-scheduling test plugin is not installed: .venv/bin/python -m pip install --no-deps --no-build-isolation ./tests/vllm_async_plugin"
  exit 1
}

P_BLOCKS="${GONIXL_PRESSURE_PREFILL_BLOCKS:-48}"
D_BLOCKS="${GONIXL_PRESSURE_DECODE_BLOCKS:-48}"
CHUNK="${GONIXL_PRESSURE_CHUNK:-64}"
LEASE="${GONIXL_PRESSURE_LEASE:-120}"
GO_ENGINE="${GONIXL_PRESSURE_ENGINE:-ucx}"
SUMMARY="$LOGS/pressure_summary.jsonl"

CONFIGS=()
IFS=',' read -r -a _requested <<<"${GONIXL_PRESSURE_CONFIGS:-pull:go-go,push:go-go}"
for c in "${_requested[@]}"; do
  c=${c// /}
  [ -n "$c" ] || continue
  [[ $c =~ ^(pull|push):(go-go|go-stock|stock-go)$ ]] || {
    e2e_say "bad configuration '$c' in GONIXL_PRESSURE_CONFIGS (want pull|push:go-go|go-stock|stock-go)"
    exit 2
  }
  CONFIGS+=("$c")
done
[ ${#CONFIGS[@]} -gt 0 ] || { e2e_say "GONIXL_PRESSURE_CONFIGS names no configuration"; exit 2; }

RESULTS=()
e2e_at_exit() {
  local r
  for r in "${RESULTS[@]}"; do e2e_say "$r"; done
  e2e_say "model $(basename "$MODEL"), configurations ${CONFIGS[*]}: $([ "$1" -eq 0 ] && echo passed || echo "FAILED (rc=$1)") in $(e2e_elapsed) s"
}

# stop_pids PID...: stops those process groups (started by start) and forgets them.
stop_pids() {
  local pid _ alive keep=()
  for pid in "$@"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    alive=0
    for pid in "$@"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.2
  done
  for pid in "$@"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do [[ " $* " == *" $pid "* ]] || keep+=("$pid"); done
  PIDS=(${keep[@]+"${keep[@]}"})
}

# kv_config KIND ROLE MODE ENGINE: the --kv-transfer-config of one instance.
kv_config() {
  local kind=$1 role=$2 mode=$3 engine=$4
  if [ "$kind" = go ]; then
    local conn=GoNixlConnector
    [ "$mode" = push ] && conn=GoNixlPushConnector
    GONIXL_CONNECTOR=$conn gonixl_kv_config_extra "$role" "$engine" "\"kv_lease_duration\":$LEASE"
  else
    local conn=NixlConnector
    [ "$mode" = push ] && conn=NixlPushConnector
    STOCK_CONNECTOR=$conn stock_kv_config "$role" | sed "s/}\$/,\"kv_connector_extra_config\":{\"kv_lease_duration\":$LEASE}}/"
  fi
}

# The aggregated baseline: ./build.sh test's shared one for this model, or
# one started here (tests/e2e/lib.sh).
e2e_baseline
SAVED=("${COMMON[@]}")
FAILED=0
for cfg in "${CONFIGS[@]}"; do
  mode=${cfg%%:*} pair=${cfg#*:}
  pk=${pair%-*} dk=${pair#*-}
  tag="$mode-$pk-$dk"
  engine=$GO_ENGINE
  if [ "$pk" = stock ] || [ "$dk" = stock ]; then engine=nixl; fi
  P_PORT=$(free_port); D_PORT=$(free_port); X_PORT=$(free_port)
  P_SIDE=$(free_port); D_SIDE=$(free_port); P_MET=$(free_port); D_MET=$(free_port)
  COMMON=("${SAVED[@]}" --num-gpu-blocks-override "$P_BLOCKS" --enable-chunked-prefill --max-num-batched-tokens "$CHUNK")
  start_vllm "$tag-prefill" "$P_PORT" "$P_SIDE" "$(kv_config "$pk" kv_producer "$mode" "$engine")" GONIXL_METRICS_PORT="$P_MET"
  P_PID=${PIDS[-1]}
  COMMON=("${SAVED[@]}" --num-gpu-blocks-override "$D_BLOCKS")
  start_vllm "$tag-decode" "$D_PORT" "$D_SIDE" "$(kv_config "$dk" kv_consumer "$mode" "$engine")" GONIXL_METRICS_PORT="$D_MET"
  D_PID=${PIDS[-1]}
  COMMON=("${SAVED[@]}")
  PROXY_FLAGS=()
  [ "$mode" = push ] && PROXY_FLAGS=(--push)
  start_proxy "$tag-proxy" "$X_PORT" "$P_PORT" "$D_PORT"
  X_PID=${PIDS[-1]}
  e2e_say "$cfg: prefill ($pk, $P_BLOCKS blocks, chunks of $CHUNK tokens) and decode ($dk, $D_BLOCKS blocks), engine $engine; logs in $LOGS"
  wait_ready "$tag-proxy" "http://127.0.0.1:$X_PORT/healthcheck"
  wait_ready "$tag-prefill" "http://127.0.0.1:$P_PORT/health"
  wait_ready "$tag-decode" "http://127.0.0.1:$D_PORT/health"
  e2e_baseline_wait
  [ "$pk" = go ] && wait_log "$tag-prefill" "$LOGS/$tag-prefill.log" 'gonixl metrics served' >/dev/null
  [ "$dk" = go ] && wait_log "$tag-decode" "$LOGS/$tag-decode.log" 'gonixl metrics served' >/dev/null
  e2e_say "$cfg: servers ready after $(e2e_elapsed) s"
  GONIXL_PR_INSTANCES=$(printf '{"prefill":{"url":"http://127.0.0.1:%s","log":"%s","gonixl":%s},"decode":{"url":"http://127.0.0.1:%s","log":"%s","gonixl":%s},"baseline":{"url":"http://127.0.0.1:%s","log":"%s","gonixl":false}}' \
    "$P_PORT" "$LOGS/$tag-prefill.log" "$([ "$pk" = go ] && echo true || echo false)" \
    "$D_PORT" "$LOGS/$tag-decode.log" "$([ "$dk" = go ] && echo true || echo false)" \
    "${BASELINE_URL##*:}" "$([ -n "${BASELINE_PGID:-}" ] && echo "$LOGS/baseline.log")")
  ABANDON_N="${GONIXL_PRESSURE_ABANDON:-16}"
  if [ "$mode" = push ] && [ "$dk" = stock ]; then
    # vLLM 0.32's push decode keeps, until it restarts, the blocks of a
    # request aborted after it registered them when no WRITE comes (its
    # prefill's request was aborted with the client): it has no failure
    # message, and request_finished drops the registration's deadline.
    # gonixl's decode is told (GONIXL_PUSH_FAILED) and frees them.
    e2e_skip_part "$E2E_NAME:$cfg:abandon" "a stock push decode keeps an abandoned request's registered blocks for ever when its prefill request is aborted too (vLLM 0.32 push_scheduler.request_finished)"
    ABANDON_N=0
  fi
  t0=$(e2e_elapsed)
  if GONIXL_PRESSURE_ABANDON="$ABANDON_N" GONIXL_PR_CONFIG="$cfg" GONIXL_PR_PROXY="http://127.0.0.1:$X_PORT" GONIXL_PR_PROXY_LOG="$LOGS/$tag-proxy.log" \
    GONIXL_PR_BASELINE="$BASELINE_URL" GONIXL_PR_MODEL="$MODEL" GONIXL_PR_INSTANCES="$GONIXL_PR_INSTANCES" \
    GONIXL_PR_LEASE="$LEASE" GONIXL_PR_SUMMARY="$SUMMARY" \
    e2e_pytest "$PY" -m pytest -q -rA -s -p no:cacheprovider "$ROOT/tests/e2e/test_pressure.py"; then
    RESULTS+=("$cfg: passed in $(($(e2e_elapsed) - t0)) s of load and checks")
  else
    RESULTS+=("$cfg: FAILED")
    FAILED=1
  fi
  stop_pids "$P_PID" "$D_PID" "$X_PID"
done
# A shared baseline stays up for the steps after this one.
[ -z "${BASELINE_PGID:-}" ] || stop_pids "$BASELINE_PGID"
exit "$FAILED"
