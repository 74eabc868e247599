#!/usr/bin/env bash
# End-to-end bidirectional KV transfer (multi-turn): two prefill vLLMs and two
# decode vLLMs with GoNixlConnector and bidirectional_kv_xfer, gonixl-proxy in
# --multiturn mode in front (round robin over each), an aggregated vLLM
# as the baseline; then tests/e2e/test_multiturn.py (conversations of 4 turns
# through /v1/chat/completions, some concurrent, an edited history, turns
# without conversation_id, streaming turns).
#
# The prefills run without prefix caching so that every token a turn does
# not compute is a token it pulled from the decode: the test then proves
# "the prefill computed only the new tokens" from vLLM's own counters,
# exactly. The decodes' TTL (decoder_kv_blocks_ttl) is GONIXL_MT_TTL seconds
# (default 40) so that the idle-conversation case fits in the run; the
# proxy's cache keeps entries 30 s longer, so that an idle conversation
# reaches a prefill with the params of blocks the decode has freed.
#
# GONIXL_MT_INTEROP=1 mixes in vLLM's stock NixlConnector: prefill1 and
# decode0 are stock (bidirectional_kv_xfer on), prefill0 and decode1 gonixl on
# NIXL, so the round robins pair gonixl and stock both ways; the tests that
# need gonixl at both ends of a turn (the token digest, the expiry in the
# params) are skipped there, saying why.
#
# GONIXL_MT_FLEET=1x1 runs one prefill and one decode instead (./build.sh
# test: every turn's prefill then pulls from the one decode; the 2x2 fleet,
# where a turn's prefill may pull from the decode of another pairing, is in
# ./build.sh test-full).
#
# Environment knobs: GONIXL_E2E_LOGS, GONIXL_E2E_TIMEOUT, GONIXL_E2E_ENGINE
# (ucx, nixl; default ucx), GONIXL_E2E_MODEL, GONIXL_MT_TTL, GONIXL_MT_LEASE
# (kv_lease_duration, 120 s), GONIXL_MT_FLEET (2x2 or 1x1), GONIXL_MT_INTEROP.
set -euo pipefail

E2E_NAME=run_multiturn_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/tiny-copy-model}"
INTEROP="${GONIXL_MT_INTEROP:-0}"
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/multiturn$([ "$INTEROP" = 1 ] && echo -interop)}"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
COMMON+=(--chat-template "$ROOT/tests/e2e/chat_template.jinja")
ENGINE="${GONIXL_E2E_ENGINE:-ucx}"
[ "$INTEROP" = 1 ] && ENGINE=nixl
TTL="${GONIXL_MT_TTL:-40}"
# The prefills' lease on the blocks a decode reads (the decodes' TTL is the
# lease of the history they keep): longer than vLLM's 30 s, so that a turn
# that waits in a starved decode's queue still finds its KV (this test is
# about bidirectional transfer; the fault suite tests lapsed leases).
LEASE="${GONIXL_MT_LEASE:-120}"

# The fleet: GONIXL_MT_FLEET prefills x decodes, 2x2 (default) or 1x1.
case "${GONIXL_MT_FLEET:-2x2}" in
  2x2) NP=2 ND=2 ;;
  1x1) NP=1 ND=1 ;;
  *) e2e_say "GONIXL_MT_FLEET=${GONIXL_MT_FLEET}: want 2x2 or 1x1"; exit 2 ;;
esac
[ "$INTEROP" != 1 ] || [ "$NP$ND" = 22 ] || { e2e_say "GONIXL_MT_INTEROP=1 needs GONIXL_MT_FLEET=2x2"; exit 2; }
X_PORT=$(free_port)
EXTRA="\"bidirectional_kv_xfer\":true,\"decoder_kv_blocks_ttl\":$TTL,\"kv_lease_duration\":$LEASE"
go_cfg() { gonixl_kv_config_extra "$1" "$ENGINE" "$EXTRA"; }
stock_cfg() {
  printf '{"kv_connector":"NixlConnector","kv_role":"%s","kv_buffer_device":"cpu","kv_connector_extra_config":{%s}}' "$1" "$EXTRA"
}
P_PORTS=() D_PORTS=() P_URLS=() D_URLS=()
SAVED=("${COMMON[@]}")
COMMON+=(--no-enable-prefix-caching)
for i in $(seq 0 $((NP - 1))); do
  cfg=$(go_cfg kv_producer)
  [ "$INTEROP" = 1 ] && [ "$i" = 1 ] && cfg=$(stock_cfg kv_producer)
  P_PORTS+=("$(free_port)")
  # gonixl's own metrics (the read-backs' KV digest counters), and the
  # test-only damage of READs of requests named for it (shim/kvfault.go).
  start_vllm "prefill$i" "${P_PORTS[i]}" "$(free_port)" "$cfg" GONIXL_METRICS_PORT="$(free_port)" GONIXL_TEST_KV_FAULT=1
  P_URLS+=("http://127.0.0.1:${P_PORTS[i]}")
done
COMMON=("${SAVED[@]}")
for i in $(seq 0 $((ND - 1))); do
  cfg=$(go_cfg kv_consumer)
  [ "$INTEROP" = 1 ] && [ "$i" = 0 ] && cfg=$(stock_cfg kv_consumer)
  D_PORTS+=("$(free_port)")
  start_vllm "decode$i" "${D_PORTS[i]}" "$(free_port)" "$cfg" GONIXL_METRICS_PORT="$(free_port)"
  D_URLS+=("http://127.0.0.1:${D_PORTS[i]}")
done
e2e_baseline
start proxy "$PROXY_BIN" --multiturn --host 127.0.0.1 --port "$X_PORT" \
  --prefiller-hosts $(printf '127.0.0.1 %.0s' "${P_PORTS[@]}") --prefiller-ports "${P_PORTS[@]}" \
  --decoder-hosts $(printf '127.0.0.1 %.0s' "${D_PORTS[@]}") --decoder-ports "${D_PORTS[@]}" --cache-ttl "$((TTL + 30))" --log-level debug

wait_ready proxy "http://127.0.0.1:$X_PORT/healthcheck"
for i in $(seq 0 $((NP - 1))); do wait_ready "prefill$i" "${P_URLS[i]}/health"; done
for i in $(seq 0 $((ND - 1))); do wait_ready "decode$i" "${D_URLS[i]}/health"; done
e2e_baseline_wait

export GONIXL_MT_PROXY="http://127.0.0.1:$X_PORT" GONIXL_MT_BASELINE="$BASELINE_URL"
export GONIXL_MT_PREFILLS="${P_URLS[*]}" GONIXL_MT_DECODES="${D_URLS[*]}"
export GONIXL_MT_LOGS="$LOGS" GONIXL_E2E_MODEL="$MODEL" GONIXL_MT_TTL="$TTL" GONIXL_MT_INTEROP="$INTEROP"
e2e_say "servers ready after $(e2e_elapsed) s"
e2e_pytest "$PY" -m pytest -q -rA -s -p no:cacheprovider "$ROOT/tests/e2e/test_multiturn.py"
e2e_say "passed in $(e2e_elapsed) s"
