#!/usr/bin/env bash
# ./build.sh bench and ./build.sh bench-push: real vLLM prefill and decode
# instances behind gonixl-proxy, one deployment at a time, the same workload
# through each (docs/BENCHMARKS.md "vLLM's stock NixlConnector vs gonixl" and
# "Push vs pull").
#
#   bench/run_vllm_bench.sh connector   # stock NixlConnector, gonixl (nixl engine, posting off and on
#                                       # vLLM's thread), gonixl (ucx engine, kv_digest on and off)
#   bench/run_vllm_bench.sh push        # gonixl pull, gonixl push, stock pull, stock push
#
# Every instance loads its connector through bench/timed_connector.py (the
# same timing wrapper around the stock classes and gonixl's), which logs each
# engine step's time inside the connector and each request's timeline to
# $OUT/raw/<deployment>-<round>/{prefill,decode}/. bench/vllm_bench.py sends
# the workload (fresh prompts of 128 and 1000 tokens; 1, 8, 32 concurrent for
# "connector", 1 and 8 for "push"); bench/vllm_report.py writes the tables and
# plots. Deployments run in order, then again in reverse order (rounds), so
# that drift on this shared machine falls on every deployment alike.
#
# Same fixture (28-layer GQA, block size 32), same vLLM, same NIXL for both
# connectors (gonixl's transfer_engine "nixl"; its own "ucx" engine is
# reported beside). Knobs: GONIXL_BENCH_ROUNDS (2), GONIXL_BENCH_MODEL,
# GONIXL_BENCH_OUT, GONIXL_BENCH_LENGTHS (128,1000), GONIXL_BENCH_CONCURRENCY,
# GONIXL_BENCH_MIN_REQUESTS (16 per case; at least 2 × concurrency),
# GONIXL_BENCH_ONLY (comma-separated deployment labels to run).
set -euo pipefail

SET=${1:-connector}
[ "$SET" = push ] && CMD_NAME="./build.sh bench-push" || CMD_NAME="./build.sh bench"
E2E_NAME=run_vllm_bench
source "$(dirname "${BASH_SOURCE[0]}")/../tests/e2e/lib.sh"

case "$SET" in
  connector)
    order=("stock stock nixl pull" "gonixl-nixl go nixl pull" "gonixl-nixl-inplace go nixl/inplace pull" "gonixl-ucx go ucx pull"
           "gonixl-ucx-nodigest go ucx/nodigest pull")
    CONC=${GONIXL_BENCH_CONCURRENCY:-1,8,32}
    OUT="${GONIXL_BENCH_OUT:-$ROOT/docs/data/connector-vs-stock}" ;;
  push)
    order=("gonixl-pull go nixl pull" "gonixl-push go nixl push" "stock-pull stock nixl pull" "stock-push stock nixl push")
    CONC=${GONIXL_BENCH_CONCURRENCY:-1,8}
    OUT="${GONIXL_BENCH_OUT:-$ROOT/docs/data/push-vs-pull}" ;;
  *) e2e_say "usage: $0 connector|push"; exit 2 ;;
esac
MODEL="${GONIXL_BENCH_MODEL:-$ROOT/tests/fixtures/geometry/llama-28l-gqa}"
ROUNDS="${GONIXL_BENCH_ROUNDS:-2}"
LENGTHS="${GONIXL_BENCH_LENGTHS:-128,1000}"
e2e_logs "$ROOT/tests/e2e/logs/bench-$SET"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
# Room for 32 concurrent 1000-token requests on each instance (the tests'
# 256 MiB and 16 sequences would queue the 32-concurrent cases in vLLM).
COMMON=(--model "$MODEL" --enforce-eager --dtype float32 --block-size 32 --max-model-len 1024
        --kv-cache-memory-bytes 805306368 --max-num-seqs 32)
rm -rf "$OUT/raw"
mkdir -p "$OUT/raw"

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

# kv_config IMPL ENGINE MODE ROLE: the timed class of the connector. ENGINE
# nixl/inplace is the nixl engine posting on vLLM's thread
# (post_off_model_thread false: the copy in start_load_kv, as stock does);
# ENGINE ucx/nodigest is the ucx engine with kv_digest off (the digests'
# cost: gonixl-ucx beside it has the default, fail).
kv_config() {
  local impl=$1 engine=$2 mode=$3 role=$4 cls extra=""
  if [ "$engine" = nixl/inplace ]; then engine=nixl; extra=',"post_off_model_thread":false'; fi
  if [ "$engine" = ucx/nodigest ]; then engine=ucx; extra=',"kv_digest":"off"'; fi
  if [ "$impl" = go ]; then
    [ "$mode" = push ] && cls=TimedGoNixlPushConnector || cls=TimedGoNixlConnector
    printf '{"kv_connector":"%s","kv_connector_module_path":"timed_connector","kv_role":"%s","kv_connector_extra_config":{"transfer_engine":"%s","kv_lease_duration":120%s}}' "$cls" "$role" "$engine" "$extra"
  else
    [ "$mode" = push ] && cls=TimedNixlPushConnector || cls=TimedNixlConnector
    printf '{"kv_connector":"%s","kv_connector_module_path":"timed_connector","kv_role":"%s","kv_buffer_device":"cpu"}' "$cls" "$role"
  fi
}

run_one() { # label impl engine mode round
  local label=$1 impl=$2 engine=$3 mode=$4 round=$5
  if [ -n "${GONIXL_BENCH_ONLY:-}" ] && [[ ",$GONIXL_BENCH_ONLY," != *",$label,"* ]]; then return; fi
  local P_PORT D_PORT X_PORT P_SIDE D_SIDE dir
  P_PORT=$(free_port); D_PORT=$(free_port); X_PORT=$(free_port); P_SIDE=$(free_port); D_SIDE=$(free_port)
  dir="$OUT/raw/$label-$round"
  mkdir -p "$dir/prefill" "$dir/decode"
  PROXY_FLAGS=()
  [ "$mode" = push ] && PROXY_FLAGS=(--push)
  start_vllm "prefill-$label-$round" "$P_PORT" "$P_SIDE" "$(kv_config "$impl" "$engine" "$mode" kv_producer)" \
    PYTHONPATH="$ROOT/bench" GONIXL_BENCH_TIMING_DIR="$dir/prefill"
  start_vllm "decode-$label-$round" "$D_PORT" "$D_SIDE" "$(kv_config "$impl" "$engine" "$mode" kv_consumer)" \
    PYTHONPATH="$ROOT/bench" GONIXL_BENCH_TIMING_DIR="$dir/decode"
  start_proxy "proxy-$label-$round" "$X_PORT" "$P_PORT" "$D_PORT"
  wait_ready proxy "http://127.0.0.1:$X_PORT/healthcheck"
  wait_ready prefill "http://127.0.0.1:$P_PORT/health"
  wait_ready decode "http://127.0.0.1:$D_PORT/health"
  e2e_say "$label round $round: servers ready; measuring (load $(cut -d' ' -f1-3 /proc/loadavg))"
  "$PY" "$ROOT/bench/vllm_bench.py" --proxy "http://127.0.0.1:$X_PORT" --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT" \
    --model "$MODEL" --label "$label" --lengths "$LENGTHS" --concurrency "$CONC" \
    --min-requests "${GONIXL_BENCH_MIN_REQUESTS:-16}" --out "$dir/client.json"
  sleep 3 # the connector wrapper writes its last records once a second
  stop_all
}

e2e_say "set $SET: ${#order[@]} deployments × $ROUNDS rounds, lengths $LENGTHS, concurrency $CONC; raw data in $OUT/raw"
for ((round = 1; round <= ROUNDS; round++)); do
  if ((round % 2)); then
    for spec in "${order[@]}"; do run_one $spec "$round"; done
  else
    for ((i = ${#order[@]} - 1; i >= 0; i--)); do run_one ${order[$i]} "$round"; done
  fi
done
"$PY" "$ROOT/bench/vllm_report.py" --set "$SET" --cmd "$CMD_NAME" "$OUT"
