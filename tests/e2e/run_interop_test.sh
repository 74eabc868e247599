#!/usr/bin/env bash
# End-to-end interop matrix: vLLM's stock NixlConnector and gonixl's
# GoNixlConnector (transfer_engine nixl) on either side of a disaggregated
# prefill -> decode pair, every requested combination against one set of
# servers started once; then tests/e2e/test_interop.py.
#
#   tests/e2e/run_interop_test.sh
#   GONIXL_INTEROP_COMBOS=stock-stock,go-go tests/e2e/run_interop_test.sh
#
# Started here: an aggregated vLLM without a connector (the baseline); a
# prefill (kv_producer) and/or a decode (kv_consumer) vLLM per connector kind
# that the combinations name (at most four); one gonixl-proxy per combination.
# A decode serves every combination that names it, and a prefill too. Every
# process is stopped on exit, also on failure (lib.sh), and the last lines of
# each log are printed when the run fails.
#
# Environment knobs:
#   GONIXL_INTEROP_COMBOS   comma list of PREFILL-DECODE, each side go or stock
#                           (default go-go,stock-go,go-stock; stock-stock is the control)
#   GONIXL_E2E_MODEL        model folder (default tests/fixtures/geometry/llama-28l-gqa
#                           when it exists, else tests/fixtures/tiny-copy-model)
#   GONIXL_INTEROP_PROMPTS  prompts per combination (24); GONIXL_INTEROP_CONCURRENCY (4),
#                           GONIXL_INTEROP_REQUEST_TIMEOUT (300 s): see test_interop.py
#   GONIXL_E2E_LOGS         log folder (default tests/e2e/logs/interop)
#   GONIXL_E2E_TIMEOUT      seconds to wait for the servers (600)
#   GONIXL_INTEROP_GO_ENGINE transfer_engine of the gonixl instances (nixl: the stock
#                           connector's own NIXL; ucx for gonixl's engine, go-go only)
#   GONIXL_INTEROP_PUSH     1: push mode (GoNixlPushConnector / NixlPushConnector on every
#                           instance, gonixl-proxy --push)
#   GONIXL_INTEROP_LEASE    kv_lease_duration of every instance, stock and gonixl (120 s):
#                           the matrix tests wire compatibility, not leases (the fault suite
#                           does); on 2 loaded cores a request can wait in the decode's queue
#                           past vLLM's 30 s default, and its READ is then rightly refused
set -euo pipefail

E2E_NAME=run_interop_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [ -n "${GONIXL_E2E_MODEL:-}" ]; then
  MODEL=$GONIXL_E2E_MODEL
elif [ -f "$ROOT/tests/fixtures/geometry/llama-28l-gqa/config.json" ]; then
  MODEL=$ROOT/tests/fixtures/geometry/llama-28l-gqa
else
  MODEL=$ROOT/tests/fixtures/tiny-copy-model
fi
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/interop}"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
SUMMARY="$LOGS/summary.txt"
: >"$SUMMARY"

e2e_at_exit() {
  [ -s "$SUMMARY" ] && cat "$SUMMARY" >&2
  e2e_say "model $(basename "$MODEL"), combinations ${COMBOS[*]:-none}: $([ "$1" -eq 0 ] && echo passed || echo "FAILED (rc=$1)") in $(e2e_elapsed) s (servers ready after ${READY_S:-n/a} s; load average at start $LOAD0, now $(cut -d' ' -f1-3 /proc/loadavg))"
}

# The combinations, checked and without repeats.
COMBOS=()
IFS=',' read -r -a _requested <<<"${GONIXL_INTEROP_COMBOS:-go-go,stock-go,go-stock}"
for c in "${_requested[@]}"; do
  c=${c// /}
  [ -n "$c" ] || continue
  [[ $c =~ ^(go|stock)-(go|stock)$ ]] || { e2e_say "bad combination '$c' in GONIXL_INTEROP_COMBOS (want PREFILL-DECODE, each go or stock)"; exit 2; }
  [[ " ${COMBOS[*]} " == *" $c "* ]] || COMBOS+=("$c")
done
[ ${#COMBOS[@]} -gt 0 ] || { e2e_say "GONIXL_INTEROP_COMBOS names no combination"; exit 2; }

# Connector instances: prefill-go, prefill-stock, decode-go, decode-stock, as needed.
# VLLM_SERVER_DEV_MODE=1 serves /reset_prefix_cache, which test_interop.py
# calls between combinations.
interop_push_from_env
declare -A PORT SIDE
LEASE="${GONIXL_INTEROP_LEASE:-120}"
kv_config() { # kind role
  if [ "$1" = go ]; then
    gonixl_kv_config_extra "$2" "${GONIXL_INTEROP_GO_ENGINE:-nixl}" "\"kv_lease_duration\":$LEASE"
  else
    stock_kv_config "$2" | sed "s/}\$/,\"kv_connector_extra_config\":{\"kv_lease_duration\":$LEASE}}/"
  fi
}
for c in "${COMBOS[@]}"; do
  for inst in "prefill-${c%-*}" "decode-${c#*-}"; do
    [ -z "${PORT[$inst]:-}" ] || continue
    PORT[$inst]=$(free_port); SIDE[$inst]=$(free_port)
    role=kv_producer; [ "${inst%-*}" = decode ] && role=kv_consumer
    start_vllm "$inst" "${PORT[$inst]}" "${SIDE[$inst]}" "$(kv_config "${inst#*-}" "$role")" VLLM_SERVER_DEV_MODE=1
  done
done
interop_matrix_run

