#!/usr/bin/env bash
# The aggregated baseline of one model, shared by several steps of
# ./build.sh test instead of one per step: a vLLM without a connector (lib.sh's
# COMMON flags, plus the chat template of the multi-turn and router tests),
# on a free port, until this script is stopped (SIGTERM; lib.sh's exit trap
# stops the server). The server answers to the model's absolute path and to
# its path relative to the repository.
#
#   tests/e2e/run_baseline.sh MODEL URL_FILE
#
# URL_FILE gets the server's URL as soon as it is started (before it is
# ready: each step waits for it with e2e_baseline_wait, lib.sh). A step uses
# it when GONIXL_E2E_SHARED_BASELINE is that URL and
# GONIXL_E2E_SHARED_BASELINE_MODEL names the step's model.
set -euo pipefail

E2E_NAME=run_baseline
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL=${1:?usage: run_baseline.sh MODEL URL_FILE}
URL_FILE=${2:?usage: run_baseline.sh MODEL URL_FILE}
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/baseline-$(basename "$MODEL")}"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
# Every name a step may send as "model": the path as given, the real path,
# and either relative to the repository.
NAMES=()
for n in "$MODEL" "$(realpath "$MODEL")" "${MODEL#"$ROOT"/}" "$(realpath --relative-to="$ROOT" "$MODEL")"; do
  [[ " ${NAMES[*]} " == *" $n "* ]] || NAMES+=("$n")
done
COMMON+=(--chat-template "$ROOT/tests/e2e/chat_template.jinja" --served-model-name "${NAMES[@]}")
PORT=$(free_port)
start_vllm baseline "$PORT"
echo "http://127.0.0.1:$PORT" >"$URL_FILE.tmp"
mv "$URL_FILE.tmp" "$URL_FILE"
wait_ready baseline "http://127.0.0.1:$PORT/health"
e2e_say "$(basename "$MODEL") ready after $(e2e_elapsed) s"
# Until stopped, or until the server exits (the steps then fail to reach it).
wait
