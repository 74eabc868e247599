#!/usr/bin/env bash
# A fleet end to end: several gonixl-proxy replicas sharing their multi-turn
# state in Redis, the decodes' KV events, and vllm-router's cache-aware
# prefill policy, all in front of the same gonixl instances.
#
# Phase 1 (tests/e2e/test_fleet.py): redis-server (its own port and data
# folder, no persistence), two prefill vLLMs (no prefix caching: every prompt
# token they do not compute is one they pulled) and two decode vLLMs with
# GoNixlConnector and bidirectional_kv_xfer, the decodes and an aggregated
# baseline vLLM publishing KV events (--kv-events-config, ZMQ on ipc:// in
# the log folder). The test starts two gonixl-proxy --multiturn replicas with
# --state-store redis://..., sends conversations whose turns alternate between
# them, restarts one mid-conversation, and subscribes to the KV events.
#
# Phase 2 (tests/e2e/test_fleet_router.py; GONIXL_FLEET_ROUTER=0 skips it,
# saying so): the prefills are restarted with prefix caching, and two
# vllm-routers in P/D mode front the same 2 prefills and 2 decodes, one with
# --prefill-policy round_robin, one with --prefill-policy cache_aware; the
# same shape of workload (groups of prompts sharing a prefix) through each:
# outputs equal to the baseline's, the prefills' local_cache_hit tokens per
# policy.
#
# At most five vLLM processes are alive at once. Environment knobs:
# GONIXL_E2E_LOGS, GONIXL_E2E_TIMEOUT, GONIXL_E2E_ENGINE (ucx, nixl),
# GONIXL_E2E_MODEL, GONIXL_FLEET_TTL (the decodes' decoder_kv_blocks_ttl,
# default 120 s), GONIXL_FLEET_ROUTER, GONIXL_ROUTER_BIN, GONIXL_REDIS_SERVER.
set -euo pipefail

E2E_NAME=run_fleet_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/tiny-copy-model}"
ROUTER="${GONIXL_FLEET_ROUTER:-1}"
ROUTER_BIN="${GONIXL_ROUTER_BIN:-$ROOT/.venv/bin/vllm-router}"
REDIS_BIN="${GONIXL_REDIS_SERVER:-$(command -v redis-server || command -v valkey-server || true)}"
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/fleet}"
e2e_require "$MODEL"
if [ -z "$REDIS_BIN" ] || [ ! -x "$REDIS_BIN" ]; then
  e2e_say "no redis-server or valkey-server binary: install Debian's redis-server (apt-get install -y redis-server) or set GONIXL_REDIS_SERVER"
  exit 1
fi
if [ "$ROUTER" = 1 ] && [ ! -x "$ROUTER_BIN" ]; then
  e2e_say "$ROUTER_BIN missing: run ./build.sh setup (requirements.lock pins vllm-router)"
  exit 1
fi
e2e_vllm_args "$MODEL"
COMMON+=(--chat-template "$ROOT/tests/e2e/chat_template.jinja")
ENGINE="${GONIXL_E2E_ENGINE:-ucx}"
TTL="${GONIXL_FLEET_TTL:-120}"
EXTRA="\"bidirectional_kv_xfer\":true,\"decoder_kv_blocks_ttl\":$TTL"
go_cfg() { gonixl_kv_config_extra "$1" "$ENGINE" "$EXTRA"; }
# KV events over ipc:// in the log folder: the publisher binds, nothing
# listens on a network port.
EVDIR="$LOGS/kv-events"
rm -rf "$EVDIR" && mkdir -p "$EVDIR"
events_cfg() {
  printf '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"ipc://%s/%s.sock","topic":"kv"}' "$EVDIR" "$1"
}

R_PORT=$(free_port)
mkdir -p "$LOGS/redis-data" && rm -f "$LOGS/redis-data"/*
start redis "$REDIS_BIN" --port "$R_PORT" --bind 127.0.0.1 --dir "$LOGS/redis-data" --save "" --appendonly no \
  --daemonize no --loglevel notice
STORE="redis://127.0.0.1:$R_PORT/0"

P0_PORT=$(free_port); P1_PORT=$(free_port); D0_PORT=$(free_port); D1_PORT=$(free_port); A_PORT=$(free_port)
P0_SIDE=$(free_port); P1_SIDE=$(free_port); D0_SIDE=$(free_port); D1_SIDE=$(free_port)
XA_PORT=$(free_port); XB_PORT=$(free_port)

SAVED=("${COMMON[@]}")
COMMON+=(--no-enable-prefix-caching)
start_vllm prefill0 "$P0_PORT" "$P0_SIDE" "$(go_cfg kv_producer)"; P0_PID=${PIDS[-1]}
start_vllm prefill1 "$P1_PORT" "$P1_SIDE" "$(go_cfg kv_producer)"; P1_PID=${PIDS[-1]}
COMMON=("${SAVED[@]}" --kv-events-config "$(events_cfg decode0)")
start_vllm decode0 "$D0_PORT" "$D0_SIDE" "$(go_cfg kv_consumer)"
COMMON=("${SAVED[@]}" --kv-events-config "$(events_cfg decode1)")
start_vllm decode1 "$D1_PORT" "$D1_SIDE" "$(go_cfg kv_consumer)"
COMMON=("${SAVED[@]}" --kv-events-config "$(events_cfg baseline)")
start_vllm baseline "$A_PORT"
COMMON=("${SAVED[@]}")

for n in prefill0:$P0_PORT prefill1:$P1_PORT decode0:$D0_PORT decode1:$D1_PORT baseline:$A_PORT; do
  wait_ready "${n%%:*}" "http://127.0.0.1:${n##*:}/health"
done
e2e_say "servers ready after $(e2e_elapsed) s; state store $STORE"

# The proxy replicas' command line (the test adds --port): the same
# instances, the shared store, and an entry lifetime equal to the decodes'
# decoder_kv_blocks_ttl. The store's calls get 2 s here, not the default
# 50 ms: with five vLLMs on two cores redis-server is at times not scheduled
# for longer (seen: takes and puts timing out at 50 ms, load average 12),
# and the test counts every turn's pull exactly. A timeout's fallback to a
# full prefill is tested in go test ./proxy/... .
PROXY_ARGS=$("$PY" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' --multiturn --host 127.0.0.1 --log-level debug \
  --prefiller-hosts 127.0.0.1 127.0.0.1 --prefiller-ports "$P0_PORT" "$P1_PORT" \
  --decoder-hosts 127.0.0.1 127.0.0.1 --decoder-ports "$D0_PORT" "$D1_PORT" \
  --state-store "$STORE" --state-store-timeout 2 --decoder-kv-blocks-ttl "$TTL")
export GONIXL_FLEET_BASELINE="http://127.0.0.1:$A_PORT" GONIXL_FLEET_PROXY_BIN="$PROXY_BIN" GONIXL_FLEET_PROXY_ARGS="$PROXY_ARGS"
export GONIXL_FLEET_PROXY_PORTS="$XA_PORT $XB_PORT" GONIXL_FLEET_LOGS="$LOGS" GONIXL_E2E_MODEL="$MODEL"
export GONIXL_FLEET_PREFILLS="http://127.0.0.1:$P0_PORT http://127.0.0.1:$P1_PORT"
export GONIXL_FLEET_DECODES="http://127.0.0.1:$D0_PORT http://127.0.0.1:$D1_PORT"
export GONIXL_FLEET_EVENTS="{\"decode0\":\"ipc://$EVDIR/decode0.sock\",\"decode1\":\"ipc://$EVDIR/decode1.sock\",\"baseline\":\"ipc://$EVDIR/baseline.sock\"}"
e2e_pytest "$PY" -m pytest -q -rA -s -p no:cacheprovider "$ROOT/tests/e2e/test_fleet.py"
e2e_say "phase 1 (replicas sharing Redis, KV events) passed in $(e2e_elapsed) s"

if [ "$ROUTER" != 1 ]; then
  e2e_say "phase 2 (vllm-router cache_aware vs round_robin) not run: GONIXL_FLEET_ROUTER=$ROUTER"
  exit 0
fi

# Phase 2: the prefills again, with prefix caching (what cache-aware routing
# is for), on new ports; the decodes and the baseline stay.
for pid in "$P0_PID" "$P1_PID"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
for _ in $(seq 1 50); do
  kill -0 -- "-$P0_PID" 2>/dev/null || kill -0 -- "-$P1_PID" 2>/dev/null || break
  sleep 0.2
done
for pid in "$P0_PID" "$P1_PID"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
NEW_PIDS=()
for pid in "${PIDS[@]}"; do [ "$pid" = "$P0_PID" ] || [ "$pid" = "$P1_PID" ] || NEW_PIDS+=("$pid"); done
PIDS=("${NEW_PIDS[@]}")
Q0_PORT=$(free_port); Q1_PORT=$(free_port); Q0_SIDE=$(free_port); Q1_SIDE=$(free_port)
start_vllm prefill0-cached "$Q0_PORT" "$Q0_SIDE" "$(go_cfg kv_producer)"
start_vllm prefill1-cached "$Q1_PORT" "$Q1_SIDE" "$(go_cfg kv_producer)"
wait_ready prefill0-cached "http://127.0.0.1:$Q0_PORT/health"
wait_ready prefill1-cached "http://127.0.0.1:$Q1_PORT/health"

RR_PORT=$(free_port); CA_PORT=$(free_port); RRM_PORT=$(free_port); CAM_PORT=$(free_port)
router() { # NAME PORT METRICS_PORT PREFILL_POLICY
  start "$1" "$ROUTER_BIN" --vllm-pd-disaggregation \
    --prefill "http://127.0.0.1:$Q0_PORT" --prefill "http://127.0.0.1:$Q1_PORT" \
    --decode "http://127.0.0.1:$D0_PORT" --decode "http://127.0.0.1:$D1_PORT" \
    --prefill-policy "$4" --decode-policy round_robin --host 127.0.0.1 --port "$2" --log-level info \
    --prometheus-host 127.0.0.1 --prometheus-port "$3" --worker-startup-check-interval 2
}
router router-rr "$RR_PORT" "$RRM_PORT" round_robin
router router-ca "$CA_PORT" "$CAM_PORT" cache_aware
wait_ready router-rr "http://127.0.0.1:$RR_PORT/health"
wait_ready router-ca "http://127.0.0.1:$CA_PORT/health"

export GONIXL_FLEET_ROUTERS="round_robin=http://127.0.0.1:$RR_PORT cache_aware=http://127.0.0.1:$CA_PORT"
export GONIXL_FLEET_PREFILLS="http://127.0.0.1:$Q0_PORT http://127.0.0.1:$Q1_PORT"
e2e_pytest "$PY" -m pytest -q -rA -s -p no:cacheprovider "$ROOT/tests/e2e/test_fleet_router.py"
e2e_say "passed in $(e2e_elapsed) s"
