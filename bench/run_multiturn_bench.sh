#!/usr/bin/env bash
# ./build.sh bench-multiturn: bidirectional KV transfer on vs off, the same
# multi-turn workload through gonixl-proxy --multiturn in one run.
#
# Two deployments run side by side, each two prefills and one decode
# (GoNixlConnector, prefix caching on as vLLM's default) behind its own
# gonixl-proxy --multiturn: "on" with bidirectional_kv_xfer (the prefill of
# turn k pulls the history back from the decode that answered turn k-1),
# "off" without (the prefill computes whatever its own prefix cache lacks).
# gonixl-bench multiturn plays bench/workloads/multiturn_bidir.json (the
# generate_conversations format of vLLM's benchmark_serving_multi_turn.py)
# against each, in lockstep (every conversation's turn k before any turn
# k+1), GONIXL_BENCH_ROUNDS workload seeds (default 4) in the order on,
# off, off, on, on, off, ... (each seed runs on both deployments, first on
# one of them as often as on the other).
# Turns are not streamed: vLLM 0.32 returns the decode's kv_transfer_params
# only in a non-streaming response, so a streamed turn is never read back.
#
# Output: one JSON report per run in docs/data/multiturn-bidir/ (per turn:
# latency, the proxy's prefill leg from Server-Timing, and the prefills'
# vllm:prompt_tokens_by_source deltas), the plot docs/multiturn-bidir.png,
# and a markdown table on stdout (docs/BENCHMARKS.md quotes it).
#
# Environment: GONIXL_BENCH_MODEL (default the 28-layer GQA fixture),
# GONIXL_BENCH_WORKLOAD, GONIXL_BENCH_OUT, GONIXL_E2E_ENGINE (ucx, nixl).
set -euo pipefail

E2E_NAME=multiturn_bench
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../tests/e2e/lib.sh"

MODEL="${GONIXL_BENCH_MODEL:-$ROOT/tests/fixtures/geometry/llama-28l-gqa}"
WORKLOAD="${GONIXL_BENCH_WORKLOAD:-$ROOT/bench/workloads/multiturn_bidir.json}"
OUT="${GONIXL_BENCH_OUT:-$ROOT/docs/data/multiturn-bidir}"
BENCH_BIN="$ROOT/build/bin/gonixl-bench"
ENGINE="${GONIXL_E2E_ENGINE:-ucx}"
e2e_logs "$ROOT/tests/e2e/logs/multiturn-bench"
e2e_require "$MODEL"
[ -x "$BENCH_BIN" ] || { e2e_say "$BENCH_BIN missing: run ./build.sh build"; exit 1; }
e2e_vllm_args "$MODEL"
# 1 GiB of KV cache each: the decodes hold every finished turn's blocks for
# decoder_kv_blocks_ttl (480 s by default) and both seeds' conversations.
COMMON+=(--chat-template "$ROOT/tests/e2e/chat_template.jinja" --kv-cache-memory-bytes 1073741824)
mkdir -p "$OUT"

declare -A PORT
for d in on off; do
  extra='"bidirectional_kv_xfer":false'
  [ "$d" = on ] && extra='"bidirectional_kv_xfer":true'
  for r in p0 p1 d; do
    PORT[$d-$r]=$(free_port)
    role=kv_producer
    [ "$r" = d ] && role=kv_consumer
    start_vllm "$d-$r" "${PORT[$d-$r]}" "$(free_port)" "$(gonixl_kv_config_extra "$role" "$ENGINE" "$extra")"
  done
  PORT[$d-proxy]=$(free_port)
  start "$d-proxy" "$PROXY_BIN" --multiturn --host 127.0.0.1 --port "${PORT[$d-proxy]}" \
    --prefiller-hosts 127.0.0.1 127.0.0.1 --prefiller-ports "${PORT[$d-p0]}" "${PORT[$d-p1]}" \
    --decoder-hosts 127.0.0.1 --decoder-ports "${PORT[$d-d]}"
done
for d in on off; do
  wait_ready "$d-proxy" "http://127.0.0.1:${PORT[$d-proxy]}/healthcheck"
  for r in p0 p1 d; do wait_ready "$d-$r" "http://127.0.0.1:${PORT[$d-$r]}/health"; done
done
e2e_say "servers ready after $(e2e_elapsed) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"

run() { # run DEPLOYMENT SEED
  local d=$1 seed=$2
  e2e_say "run: bidirectional $d, workload seed $seed"
  "$BENCH_BIN" multiturn --url "http://127.0.0.1:${PORT[$d-proxy]}" \
    --tokenizer-url "http://127.0.0.1:${PORT[$d-d]}" --input-file "$WORKLOAD" --seed "$seed" \
    --lockstep --prefill-metrics "http://127.0.0.1:${PORT[$d-p0]}/metrics,http://127.0.0.1:${PORT[$d-p1]}/metrics" \
    --stream=false --send-conversation-id --num-clients 4 --timeout 300s \
    --json "$OUT/$d-seed$seed.json" | tee "$LOGS/bench-$d-seed$seed.txt" >&2
}
# Warm-up: every prefill/decode pair's first contact (handshake, first
# READ) happens before anything is measured.
for d in on off; do
  for i in 1 2; do
    curl -sf -o /dev/null -H 'Content-Type: application/json' "http://127.0.0.1:${PORT[$d-proxy]}/v1/chat/completions" \
      -d "{\"messages\":[{\"role\":\"user\",\"content\":\"Warm up $i.\"}],\"max_tokens\":2}"
  done
done
# ABBA pairs: on, off, off, on, ... one workload seed per run pair.
ROUNDS="${GONIXL_BENCH_ROUNDS:-4}"
rm -f "$OUT"/*-seed*.json
for ((s = 1; s <= ROUNDS; s++)); do
  if ((s % 2)); then run on "$s"; run off "$s"; else run off "$s"; run on "$s"; fi
done
cat >"$OUT/README.md" <<MD
Raw output of \`./build.sh bench-multiturn\` (bench/run_multiturn_bench.sh) on $(date -u +%Y-%m-%d):
one gonixl-bench multiturn JSON report per run (deployment on/off, workload seed).
Model $(basename "$MODEL"), engine $ENGINE, workload $(basename "$WORKLOAD"), $(nproc) CPUs.
MD
"$PY" "$ROOT/bench/plot_multiturn.py" "$OUT" "$ROOT/docs/multiturn-bidir.png"
e2e_say "done in $(e2e_elapsed) s"
