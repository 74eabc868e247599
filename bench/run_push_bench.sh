#!/usr/bin/env bash
# ./build.sh bench-push: TTFT and hand-off through gonixl-proxy, push vs pull,
# gonixl's connectors and vLLM's stock ones (docs/BENCHMARKS.md "Push vs pull").
#
# Deployments run one at a time (a prefill, a decode, the proxy; the same
# 28-layer GQA fixture, block size 32, transfer engine nixl for gonixl so
# that both sides move KV with the same NIXL): gonixl pull
# (GoNixlConnector), gonixl push (GoNixlPushConnector, proxy --push), stock
# pull (NixlConnector), stock push (NixlPushConnector, proxy --push), then
# the same four again in reverse order to cancel drift. bench/push_bench.py
# measures each (prompts of 128 and 1000 tokens, 1 and 8 concurrent).
#
# Knobs: GONIXL_BENCH_REQUESTS (16 per case), GONIXL_BENCH_MODEL,
# GONIXL_BENCH_OUT (docs/data/push-vs-pull).
set -euo pipefail

E2E_NAME=run_push_bench
source "$(dirname "${BASH_SOURCE[0]}")/../tests/e2e/lib.sh"

MODEL="${GONIXL_BENCH_MODEL:-$ROOT/tests/fixtures/geometry/llama-28l-gqa}"
OUT="${GONIXL_BENCH_OUT:-$ROOT/docs/data/push-vs-pull}"
REQUESTS="${GONIXL_BENCH_REQUESTS:-16}"
e2e_logs "$ROOT/tests/e2e/logs/push-bench"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
mkdir -p "$OUT"

stop_all() {
  local pid _ alive
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 1 50); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.2
  done
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  PIDS=()
}

run_one() { # label impl(go|stock) mode(pull|push) round
  local label=$1 impl=$2 mode=$3 round=$4
  local P_PORT D_PORT X_PORT P_SIDE D_SIDE kvp kvd
  P_PORT=$(free_port); D_PORT=$(free_port); X_PORT=$(free_port); P_SIDE=$(free_port); D_SIDE=$(free_port)
  if [ "$impl" = go ]; then
    [ "$mode" = push ] && export GONIXL_CONNECTOR=GoNixlPushConnector || export GONIXL_CONNECTOR=GoNixlConnector
    kvp=$(gonixl_kv_config_extra kv_producer nixl '"kv_lease_duration":120')
    kvd=$(gonixl_kv_config_extra kv_consumer nixl '"kv_lease_duration":120')
  else
    [ "$mode" = push ] && export STOCK_CONNECTOR=NixlPushConnector || export STOCK_CONNECTOR=NixlConnector
    kvp=$(stock_kv_config kv_producer); kvd=$(stock_kv_config kv_consumer)
  fi
  PROXY_FLAGS=()
  [ "$mode" = push ] && PROXY_FLAGS=(--push)
  start_vllm "prefill-$label-$round" "$P_PORT" "$P_SIDE" "$kvp"
  start_vllm "decode-$label-$round" "$D_PORT" "$D_SIDE" "$kvd"
  start_proxy "proxy-$label-$round" "$X_PORT" "$P_PORT" "$D_PORT"
  wait_ready proxy "http://127.0.0.1:$X_PORT/healthcheck"
  wait_ready prefill "http://127.0.0.1:$P_PORT/health"
  wait_ready decode "http://127.0.0.1:$D_PORT/health"
  e2e_say "$label round $round: servers ready; measuring"
  "$PY" "$ROOT/bench/push_bench.py" --proxy "http://127.0.0.1:$X_PORT" --prefill "http://127.0.0.1:$P_PORT" \
    --model "$MODEL" --label "$label" --requests "$REQUESTS" --out "$OUT/$label-$round.json"
  stop_all
}

order=("gonixl-pull go pull" "gonixl-push go push" "stock-pull stock pull" "stock-push stock push")
round=1
for spec in "${order[@]}"; do run_one $spec $round; done
round=2
for ((i = ${#order[@]} - 1; i >= 0; i--)); do run_one ${order[$i]} $round; done
"$PY" "$ROOT/bench/push_table.py" "$OUT"
