#!/usr/bin/env bash
# End to end behind vllm-router: a prefill vLLM (kv_producer) and a decode
# vLLM (kv_consumer) with GoNixlConnector behind vllm-router in its vLLM P/D
# mode (--vllm-pd-disaggregation: the prefill gets the request with
# max_tokens 1 and kv_transfer_params asking for a remote decode, then the
# decode gets it with the prefill's kv_transfer_params; README.md, "Behind
# vllm-router"), and an aggregated vLLM without a connector as the baseline,
# all with the tiny fixture model. Then tests/e2e/test_accuracy.py through the
# router (outputs equal to the baseline's token for token, the decode's prompt
# tokens pulled from the prefill) and tests/e2e/test_router.py (streamed and
# chat requests, the router's request ids on both instances).
#
# Environment knobs: as run_accuracy_test.sh (GONIXL_E2E_LOGS, _TIMEOUT,
# _ENGINE, _MODEL), GONIXL_E2E_PROMPTS (default 16 here), and
# GONIXL_ROUTER_BIN (default .venv/bin/vllm-router, from requirements.lock).
set -euo pipefail

E2E_NAME=run_router_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/tiny-copy-model}"
ROUTER_BIN="${GONIXL_ROUTER_BIN:-$ROOT/.venv/bin/vllm-router}"
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/router}"
e2e_require "$MODEL"
[ -x "$ROUTER_BIN" ] || { e2e_say "$ROUTER_BIN missing: run ./build.sh setup (requirements.lock pins vllm-router)"; exit 1; }
e2e_vllm_args "$MODEL"
# The chat template lets test_router.py send chat requests; with
# --enable-log-requests each instance logs the request ids it was given.
COMMON+=(--chat-template "$ROOT/tests/e2e/chat_template.jinja" --enable-log-requests)

P_PORT=$(free_port); D_PORT=$(free_port); R_PORT=$(free_port); M_PORT=$(free_port)
P_SIDE=$(free_port); D_SIDE=$(free_port)

ENGINE="${GONIXL_E2E_ENGINE:-ucx}"
# A lease a starved machine does not outlast (the fault suite tests lapsed ones).
EXTRA="\"kv_lease_duration\":${GONIXL_E2E_LEASE:-120}"
start_vllm prefill "$P_PORT" "$P_SIDE" "$(gonixl_kv_config_extra kv_producer "$ENGINE" "$EXTRA")"
start_vllm decode "$D_PORT" "$D_SIDE" "$(gonixl_kv_config_extra kv_consumer "$ENGINE" "$EXTRA")"
e2e_baseline
wait_ready prefill "http://127.0.0.1:$P_PORT/health"
wait_ready decode "http://127.0.0.1:$D_PORT/health"
e2e_baseline_wait

# The router after the instances: it checks their /health once at start-up
# (then every 60 s) and would otherwise wait its --worker-startup-check-interval
# (30 s) between tries. Round robin, as gonixl-proxy; at info it logs a line
# per request (the decode's status).
start router "$ROUTER_BIN" --vllm-pd-disaggregation \
  --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT" \
  --host 127.0.0.1 --port "$R_PORT" --policy round_robin --log-level info \
  --prometheus-host 127.0.0.1 --prometheus-port "$M_PORT" --worker-startup-check-interval 2
wait_ready router "http://127.0.0.1:$R_PORT/health"

export GONIXL_E2E_PROXY="http://127.0.0.1:$R_PORT" GONIXL_E2E_BASELINE="$BASELINE_URL"
export GONIXL_E2E_PREFILL="http://127.0.0.1:$P_PORT" GONIXL_E2E_DECODE="http://127.0.0.1:$D_PORT"
export GONIXL_E2E_DECODE_LOG="$LOGS/decode.log" GONIXL_E2E_PREFILL_LOG="$LOGS/prefill.log" GONIXL_E2E_MODEL="$MODEL"
export GONIXL_E2E_ROUTER_LOG="$LOGS/router.log" GONIXL_E2E_PROMPTS="${GONIXL_E2E_PROMPTS:-16}"
e2e_pytest "$PY" -m pytest -q -rA -p no:cacheprovider "$ROOT/tests/e2e/test_accuracy.py" "$ROOT/tests/e2e/test_router.py"
e2e_say "passed in $(e2e_elapsed) s"
