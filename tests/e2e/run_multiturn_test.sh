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
# Environment knobs: GONIXL_E2E_LOGS, GONIXL_E2E_TIMEOUT, GONIXL_E2E_ENGINE
# (ucx, nixl; default ucx), GONIXL_E2E_MODEL, GONIXL_MT_TTL, GONIXL_MT_INTEROP.
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

P0_PORT=$(free_port); P1_PORT=$(free_port); D0_PORT=$(free_port); D1_PORT=$(free_port); A_PORT=$(free_port); X_PORT=$(free_port)
P0_SIDE=$(free_port); P1_SIDE=$(free_port); D0_SIDE=$(free_port); D1_SIDE=$(free_port)
EXTRA="\"bidirectional_kv_xfer\":true,\"decoder_kv_blocks_ttl\":$TTL"
go_cfg() { gonixl_kv_config_extra "$1" "$ENGINE" "$EXTRA"; }
stock_cfg() {
  printf '{"kv_connector":"NixlConnector","kv_role":"%s","kv_buffer_device":"cpu","kv_connector_extra_config":{%s}}' "$1" "$EXTRA"
}
P1_CFG=$(go_cfg kv_producer) D0_CFG=$(go_cfg kv_consumer)
if [ "$INTEROP" = 1 ]; then P1_CFG=$(stock_cfg kv_producer) D0_CFG=$(stock_cfg kv_consumer); fi

SAVED=("${COMMON[@]}")
COMMON+=(--no-enable-prefix-caching)
start_vllm prefill0 "$P0_PORT" "$P0_SIDE" "$(go_cfg kv_producer)"
start_vllm prefill1 "$P1_PORT" "$P1_SIDE" "$P1_CFG"
COMMON=("${SAVED[@]}")
start_vllm decode0 "$D0_PORT" "$D0_SIDE" "$D0_CFG"
start_vllm decode1 "$D1_PORT" "$D1_SIDE" "$(go_cfg kv_consumer)"
start_vllm baseline "$A_PORT"
start proxy "$PROXY_BIN" --multiturn --host 127.0.0.1 --port "$X_PORT" \
  --prefiller-hosts 127.0.0.1 127.0.0.1 --prefiller-ports "$P0_PORT" "$P1_PORT" \
  --decoder-hosts 127.0.0.1 127.0.0.1 --decoder-ports "$D0_PORT" "$D1_PORT" --cache-ttl "$((TTL + 30))" --log-level debug

wait_ready proxy "http://127.0.0.1:$X_PORT/healthcheck"
for n in prefill0:$P0_PORT prefill1:$P1_PORT decode0:$D0_PORT decode1:$D1_PORT baseline:$A_PORT; do
  wait_ready "${n%%:*}" "http://127.0.0.1:${n##*:}/health"
done

export GONIXL_MT_PROXY="http://127.0.0.1:$X_PORT" GONIXL_MT_BASELINE="http://127.0.0.1:$A_PORT"
export GONIXL_MT_PREFILLS="http://127.0.0.1:$P0_PORT http://127.0.0.1:$P1_PORT" GONIXL_MT_DECODES="http://127.0.0.1:$D0_PORT http://127.0.0.1:$D1_PORT"
export GONIXL_MT_LOGS="$LOGS" GONIXL_E2E_MODEL="$MODEL" GONIXL_MT_TTL="$TTL" GONIXL_MT_INTEROP="$INTEROP"
e2e_say "servers ready after $(e2e_elapsed) s"
e2e_pytest "$PY" -m pytest -q -rA -s -p no:cacheprovider "$ROOT/tests/e2e/test_multiturn.py"
e2e_say "passed in $(e2e_elapsed) s"
