#!/usr/bin/env bash
# End-to-end tensor and data parallelism: vLLM instances with
# --tensor-parallel-size 1 or 2 (and --data-parallel-size 2) on either side of
# a disaggregated prefill -> decode pair, each combination behind its own
# gonixl-proxy and checked against an aggregated TP = 1 baseline by
# tests/e2e/test_interop.py (token-exact outputs, the decode's
# prompt_tokens_by_source counters, clean logs).
#
#   tests/e2e/run_tp_test.sh
#   GONIXL_E2E_MODEL=tests/fixtures/geometry/hybrid-swa GONIXL_TP_COMBOS=go1-go2,go2-go1 tests/e2e/run_tp_test.sh
#
# Instance kinds in GONIXL_TP_COMBOS (PREFILL-DECODE):
#   go1, go2      GoNixlConnector (transfer_engine nixl), TP 1 or 2
#   ux1, ux2      GoNixlConnector (transfer_engine ucx, gonixl's own engine), TP 1 or 2
#   stock1, stock2 vLLM's NixlConnector (host buffers), TP 1 or 2
#   dp2           GoNixlConnector (transfer_engine ucx), TP 1, --data-parallel-size 2 (the proxy
#                 addresses the head instance only; each DP engine's side
#                 channel is VLLM_NIXL_SIDE_CHANNEL_PORT + its DP index)
# Default: ux2-ux2,ux1-ux2,ux2-ux1,ux1-dp2 (./build.sh test adds a hybrid-model
# run with ux1-ux2,ux2-ux1,stock2-go1). The same pairings over NIXL (go*) pass
# but a gonixl prefill at TP 2 on NIXL stalls intermittently here (requests
# of 30-120 s; docs/GEOMETRIES.md), so CI runs gonixl-to-gonixl over the UCX
# engine and NIXL through the stock-prefill interop pairing.
#
# vLLM's CPU backend runs TP = 2 here with its shared-memory communicator
# (one worker process per rank). Every process is stopped on exit (lib.sh).
# GONIXL_TP_DEBUG_PORTS=BASE gives instance i (in start order) GONIXL_METRICS_PORT BASE+10*i
# and GONIXL_DEBUG_PPROF=1: Go stacks of every process at /debug/pprof/goroutine?debug=2
# (docs/ENVIRONMENT.md), for looking at a slow or stuck run.
# Other knobs as run_interop_test.sh (GONIXL_INTEROP_PROMPTS, default 12 here;
# GONIXL_INTEROP_LEASE, GONIXL_E2E_LOGS, GONIXL_E2E_TIMEOUT).
set -euo pipefail

E2E_NAME=run_tp_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL=${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/geometry/llama-28l-gqa}
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/tp-$(basename "$MODEL")}"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
SUMMARY="$LOGS/summary.txt"
: >"$SUMMARY"
export GONIXL_INTEROP_PROMPTS="${GONIXL_INTEROP_PROMPTS:-12}"

# vLLM's CPU TP communicator leaves its shared-memory segments in /dev/shm
# when its processes are killed; those this run made are removed at exit.
SHM0=$(ls /dev/shm 2>/dev/null | grep cpushm || true)
e2e_at_exit() {
  local f
  for f in $(ls /dev/shm 2>/dev/null | grep cpushm || true); do
    grep -qxF "$f" <<<"$SHM0" || rm -f "/dev/shm/$f"
  done
  [ -s "$SUMMARY" ] && cat "$SUMMARY" >&2
  e2e_say "model $(basename "$MODEL"), combinations ${COMBOS[*]:-none}: $([ "$1" -eq 0 ] && echo passed || echo "FAILED (rc=$1)") in $(e2e_elapsed) s (servers ready after ${READY_S:-n/a} s; load average at start $LOAD0, now $(cut -d' ' -f1-3 /proc/loadavg))"
}

COMBOS=()
IFS=',' read -r -a _requested <<<"${GONIXL_TP_COMBOS:-ux2-ux2,ux1-ux2,ux2-ux1,ux1-dp2}"
for c in "${_requested[@]}"; do
  c=${c// /}
  [ -n "$c" ] || continue
  [[ $c =~ ^(go1|go2|ux1|ux2|stock1|stock2|dp2)-(go1|go2|ux1|ux2|stock1|stock2|dp2)$ ]] || { e2e_say "bad combination '$c' in GONIXL_TP_COMBOS"; exit 2; }
  [[ " ${COMBOS[*]} " == *" $c "* ]] || COMBOS+=("$c")
done
[ ${#COMBOS[@]} -gt 0 ] || { e2e_say "GONIXL_TP_COMBOS names no combination"; exit 2; }

interop_push_from_env # GONIXL_INTEROP_PUSH=1: the push connectors and gonixl-proxy --push
LEASE="${GONIXL_INTEROP_LEASE:-120}"
# A READ between two processes on one host is served by the prefill's
# progress thread; with a dozen vLLM processes spinning on 2 cores it was
# once starved past the default 60 s. The fault suite tests the timeout;
# here it only bounds a run.
XFER_TIMEOUT="${GONIXL_TP_TRANSFER_TIMEOUT:-180}"
kv_config() { # kind role
  case $1 in
    stock*) stock_kv_config "$2" | sed "s/}\$/,\"kv_connector_extra_config\":{\"kv_lease_duration\":$LEASE}}/" ;;
    ux* | dp2) gonixl_kv_config_extra "$2" ucx "\"kv_lease_duration\":$LEASE,\"transfer_timeout\":$XFER_TIMEOUT${GONIXL_TP_EXTRA:+,$GONIXL_TP_EXTRA}" ;;
    *) gonixl_kv_config_extra "$2" nixl "\"kv_lease_duration\":$LEASE,\"transfer_timeout\":$XFER_TIMEOUT${GONIXL_TP_EXTRA:+,$GONIXL_TP_EXTRA}" ;;
  esac
}
parallel_args() { # kind
  case $1 in
    go2 | ux2 | stock2) echo "--tensor-parallel-size 2" ;;
    dp2) echo "--data-parallel-size 2" ;;
  esac
}

declare -A PORT SIDE
NINST=0
for c in "${COMBOS[@]}"; do
  for inst in "prefill-${c%-*}" "decode-${c#*-}"; do
    [ -z "${PORT[$inst]:-}" ] || continue
    kind=${inst#*-}
    PORT[$inst]=$(free_port); SIDE[$inst]=$(free_port)
    # port + 1: the second DP engine's side channel, not handed out again
    [ "$kind" = dp2 ] && echo $((SIDE[$inst] + 1)) >>"$E2E_PORTS_FILE"
    role=kv_producer; [ "${inst%-*}" = decode ] && role=kv_consumer
    saved=("${COMMON[@]}")
    # shellcheck disable=SC2207
    COMMON+=($(parallel_args "$kind"))
    debug=()
    if [ -n "${GONIXL_TP_DEBUG_PORTS:-}" ]; then
      debug=(GONIXL_METRICS_PORT=$((GONIXL_TP_DEBUG_PORTS + 10 * NINST)) GONIXL_DEBUG_PPROF=1)
      e2e_say "$inst: Go stacks from port $((GONIXL_TP_DEBUG_PORTS + 10 * NINST)) on"
    fi
    NINST=$((NINST + 1))
    start_vllm "$inst" "${PORT[$inst]}" "${SIDE[$inst]}" "$(kv_config "$kind" "$role")" VLLM_SERVER_DEV_MODE=1 "${debug[@]}"
    COMMON=("${saved[@]}")
  done
done
interop_matrix_run

