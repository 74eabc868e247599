# Shared by the end-to-end scripts (run_accuracy_test.sh, run_interop_test.sh):
# paths, free ports, starting vLLM / gonixl-proxy in their own process groups,
# waiting for readiness, and stopping every process group on every exit path.
#
#   E2E_NAME=run_something   # prefix of this library's messages
#   source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# Sourcing sets ROOT (and cd's there), PY, PROXY_BIN, WAIT (GONIXL_E2E_TIMEOUT,
# default 600 s), exports the vLLM environment below, and installs the exit
# trap. The caller then runs e2e_logs DIR, e2e_require MODEL, e2e_vllm_args
# MODEL, start / start_vllm, wait_ready. A caller may define e2e_at_exit RC:
# the trap calls it after the processes are stopped and before the logs of a
# failed run are printed.
# shellcheck shell=bash

E2E_NAME=${E2E_NAME:-e2e}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
PROXY_BIN="$ROOT/build/bin/gonixl-proxy"
WAIT="${GONIXL_E2E_TIMEOUT:-600}"
E2E_T0=$SECONDS

e2e_say() { echo "$E2E_NAME: $*" >&2; }

# e2e_skip REASON: this script cannot run its test here. Prints
# "SKIP: NAME: REASON", records the skip in the step's report
# (GONIXL_TEST_REPORT, tests/testreport.py) and exits 0: ./build.sh test
# then fails the step unless tests/declared.toml declares the skip.
e2e_skip() {
  e2e_skip_part "$E2E_NAME" "$*"
  exit 0
}

# e2e_skip_part ID REASON: one part of the script (ID, e.g. "NAME:case")
# does not run; the rest goes on. Recorded like e2e_skip's.
e2e_skip_part() {
  echo "SKIP: $1: $2"
  if [ -n "${GONIXL_TEST_REPORT:-}" ]; then
    E2E_SKIP_ID="$1" E2E_SKIP_REASON="$2" python3 -c 'import json, os
rec = {"kind": "skip", "runner": "e2e", "id": os.environ["E2E_SKIP_ID"], "reason": os.environ["E2E_SKIP_REASON"], "step": os.environ.get("GONIXL_TEST_STEP", "")}
with open(os.environ["GONIXL_TEST_REPORT"], "a") as f:
    f.write(json.dumps(rec, sort_keys=True) + "\n")' || exit 1
  fi
}

# e2e_logs DIR: the log folder (created; earlier *.log files removed).
e2e_logs() {
  LOGS=$1
  mkdir -p "$LOGS"
  rm -f "$LOGS"/*.log "$LOGS"/pytest.out
}

# e2e_pytest CMD...: runs a pytest command line, its output also kept in
# $LOGS/pytest.out. When the run fails, the exit trap prints the logs' last
# lines and then, last of all, the test's own report lines and its failed
# assertions: CI shows the end of the output, and the assertion is what a
# reader needs first.
E2E_PYTEST_OUT=
e2e_pytest() {
  E2E_PYTEST_OUT="$LOGS/pytest.out"
  "$@" 2>&1 | tee "$E2E_PYTEST_OUT"
}

# e2e_require MODEL: the venv, the proxy binary and the model exist.
e2e_require() {
  [ -x "$PY" ] || { e2e_say ".venv missing: run ./build.sh setup"; exit 1; }
  [ -x "$PROXY_BIN" ] || { e2e_say "$PROXY_BIN missing: run ./build.sh build"; exit 1; }
  [ -f "$1/config.json" ] || { e2e_say "model fixture $1 missing"; exit 1; }
}

# Ports come from below the kernel's ephemeral range: vLLM binds many
# internal sockets to OS-chosen ports, which could otherwise take a port
# between our probe and the server's bind. Ports handed out earlier by this
# script are not handed out again: free_port runs in a command substitution
# (a subshell), so they are kept in a file, not a variable.
E2E_PORTS_FILE=$(mktemp "${TMPDIR:-/tmp}/gonixl-e2e-ports.XXXXXX")
free_port() {
  local port
  port=$(E2E_TAKEN="$(cat "$E2E_PORTS_FILE")" "$PY" - <<'PYEOF'
import os, random, socket
taken = set(os.environ.get("E2E_TAKEN", "").split())
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    port = random.randrange(20000, max(20001, min(lo, 32768)))
    if str(port) in taken:
        continue
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    print(port)
    break
else:
    raise SystemExit("no free port below the ephemeral range")
PYEOF
)
  echo "$port" >>"$E2E_PORTS_FILE"
  echo "$port"
}

# Every process group started by start(); all of them are stopped on exit.
PIDS=()
e2e_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  rm -f "$E2E_PORTS_FILE"
  local pid alive _
  for pid in "${PIDS[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 1 25); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.2
  done
  for pid in "${PIDS[@]}"; do
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done
  if declare -F e2e_at_exit >/dev/null; then e2e_at_exit "$rc" || true; fi
  if [ $rc -ne 0 ] && [ -n "${LOGS:-}" ]; then
    e2e_say "FAILED (rc=$rc); last lines of each log in $LOGS:"
    local f
    for f in "$LOGS"/*.log; do
      [ -e "$f" ] || continue
      echo "----- $f" >&2
      grep -v -E 'api_utils|launcher.py' "$f" | tail -n 25 >&2 || true
    done
  fi
  if [ $rc -ne 0 ] && [ -n "$E2E_PYTEST_OUT" ] && [ -s "$E2E_PYTEST_OUT" ]; then
    echo "----- $E2E_NAME: the test's report lines, then its failed assertions ($E2E_PYTEST_OUT):" >&2
    grep -v -E '^([[:space:]]|E |>|_{3,}|={3,}|-{3,}|/|tests/|[.sFE]+ *\[)' "$E2E_PYTEST_OUT" | grep -v -E $'\t(debug|info)\t' | tail -n 40 >&2 || true
    grep -E '^(E |FAILED|ERROR)' "$E2E_PYTEST_OUT" | cut -c1-800 | head -n 40 >&2 || true
  fi
  exit $rc
}
trap e2e_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# vLLM on a CPU host: offline, eager, a bounded KV cache (256 MiB), float32
# (the bfloat16 AMX attention kernel is not used; see docs/ENVIRONMENT.md),
# block size 32 (the CPU backend's minimum).
# e2e_vllm_args MODEL sets the array COMMON.
e2e_vllm_args() {
  COMMON=(--model "$1" --enforce-eager --dtype float32 --block-size 32 --max-model-len 1024
          --kv-cache-memory-bytes 268435456 --max-num-seqs 16)
}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
# Several engines share two cores: no core pinning and no OpenMP spin-waiting,
# or the engines' background threads (gonixl's handshakes among them) starve.
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE VLLM_CPU_OMP_THREADS_BIND=nobind

# --kv-transfer-config values. gonixl_kv_config ROLE ENGINE; stock_kv_config ROLE
# (vLLM's own NixlConnector, host buffers). ROLE: kv_producer or kv_consumer.
gonixl_kv_config() {
  printf '{"kv_connector":"GoNixlConnector","kv_connector_module_path":"gonixl.vllm","kv_role":"%s","kv_connector_extra_config":{"transfer_engine":"%s"}}' \
    "$1" "$2"
}
stock_kv_config() {
  printf '{"kv_connector":"%s","kv_role":"%s","kv_buffer_device":"cpu"}' "${STOCK_CONNECTOR:-NixlConnector}" "$1"
}

# start NAME CMD...: CMD in its own process group, output to $LOGS/NAME.log.
start() {
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 &
  PIDS+=($!)
}

# start_vllm NAME HTTP_PORT [SIDE_CHANNEL_PORT KV_TRANSFER_CONFIG [ENV=VALUE...]]:
# an OpenAI API server with the COMMON flags; with a connector when given.
start_vllm() {
  local name=$1 port=$2
  if [ $# -ge 4 ]; then
    local side=$3 kv=$4
    shift 4
    start "$name" env VLLM_NIXL_SIDE_CHANNEL_PORT="$side" "$@" "$PY" -m vllm.entrypoints.openai.api_server \
      "${COMMON[@]}" --port "$port" --kv-transfer-config "$kv"
  else
    start "$name" "$PY" -m vllm.entrypoints.openai.api_server "${COMMON[@]}" --port "$port"
  fi
}

# e2e_baseline: the aggregated baseline (a vLLM without a connector, the
# COMMON flags) the outputs are compared with; sets BASELINE_URL. When
# GONIXL_E2E_SHARED_BASELINE (a URL) is set and GONIXL_E2E_SHARED_BASELINE_MODEL
# names this MODEL (the same folder), that one, already started by
# ./build.sh test for the steps of this model (tests/e2e/run_baseline.sh);
# else one started here, like the other servers. e2e_baseline_wait waits
# for it either way.
e2e_baseline() {
  if [ -n "${GONIXL_E2E_SHARED_BASELINE:-}" ] &&
    [ "$(realpath -m "${GONIXL_E2E_SHARED_BASELINE_MODEL:-/nonexistent}")" = "$(realpath -m "$MODEL")" ]; then
    BASELINE_URL=$GONIXL_E2E_SHARED_BASELINE
    e2e_say "baseline: the shared one at $BASELINE_URL (./build.sh test)"
  else
    local port
    port=$(free_port)
    start_vllm baseline "$port"
    BASELINE_PGID=${PIDS[-1]}
    BASELINE_URL="http://127.0.0.1:$port"
  fi
}
e2e_baseline_wait() { wait_ready baseline "$BASELINE_URL/health"; }
# e2e_baseline_stop: for a step that has read all it needs from the
# baseline: stops the one e2e_baseline started here, or switches a shared
# one to the answers it remembers (its vLLM stopped: the later steps of
# ./build.sh test that use it ask only prompts it has answered).
e2e_baseline_stop() {
  if [ -z "${BASELINE_PGID:-}" ]; then
    [ -z "${GONIXL_E2E_SHARED_BASELINE:-}" ] || curl -sf -X POST "$BASELINE_URL/_baseline/cache_only" >&2
    return 0
  fi
  local _ keep=() pid
  kill -TERM -- "-$BASELINE_PGID" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 -- "-$BASELINE_PGID" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL -- "-$BASELINE_PGID" 2>/dev/null || true
  for pid in "${PIDS[@]}"; do [ "$pid" = "$BASELINE_PGID" ] || keep+=("$pid"); done
  PIDS=("${keep[@]}")
  wait "$BASELINE_PGID" 2>/dev/null || true
  BASELINE_PGID=
}

# start_proxy NAME PORT PREFILL_PORT DECODE_PORT: gonixl-proxy (toy mode), at
# debug level: its per-request "routing" line (after the prefill answered,
# with how long it took) tells a hung request's side.
# PROXY_FLAGS (an array, may be unset) are added to its flags (--push).
start_proxy() {
  start "$1" "$PROXY_BIN" --log-level debug --host 127.0.0.1 --port "$2" \
    --prefiller-hosts 127.0.0.1 --prefiller-ports "$3" --decoder-hosts 127.0.0.1 --decoder-ports "$4" ${PROXY_FLAGS[@]+"${PROXY_FLAGS[@]}"}
}

# interop_push_from_env: with GONIXL_INTEROP_PUSH=1, vLLM's push connector
# on every instance (GoNixlPushConnector, NixlPushConnector) and
# gonixl-proxy --push (the interop and TP matrices).
interop_push_from_env() {
  if [ "${GONIXL_INTEROP_PUSH:-0}" = 1 ]; then
    export GONIXL_CONNECTOR=GoNixlPushConnector STOCK_CONNECTOR=NixlPushConnector
    PROXY_FLAGS=(--push)
    e2e_say "push mode: GoNixlPushConnector / NixlPushConnector, gonixl-proxy --push"
  fi
}

# wait_ready NAME URL: until URL answers, a started process exits, or WAIT passes.
wait_ready() {
  local deadline=$((SECONDS + WAIT)) pid
  until curl -sf -o /dev/null "$2"; do
    if ((SECONDS > deadline)); then e2e_say "$1 not ready after ${WAIT}s"; return 1; fi
    for pid in "${PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || { e2e_say "a server exited early (pid $pid)"; return 1; }
    done
    sleep 2
  done
  e2e_say "$1 ready"
}

# e2e_elapsed: seconds since lib.sh was sourced.
e2e_elapsed() { echo $((SECONDS - E2E_T0)); }

# gonixl_kv_config_extra ROLE ENGINE EXTRA: gonixl_kv_config with more members
# in kv_connector_extra_config; EXTRA is a JSON fragment such as
# '"kv_lease_duration":10' (run_soak_test.sh).
gonixl_kv_config_extra() {
  printf '{"kv_connector":"%s","kv_connector_module_path":"gonixl.vllm","kv_role":"%s","kv_connector_extra_config":{"transfer_engine":"%s",%s}}' \
    "${GONIXL_CONNECTOR:-GoNixlConnector}" "$1" "$2" "$3"
}

# wait_log NAME FILE REGEX: until FILE has a line matching the extended
# REGEX (printed), a started process exits, or WAIT passes.
wait_log() {
  local deadline=$((SECONDS + WAIT)) pid line
  until line=$(grep -m1 -E "$3" "$2" 2>/dev/null); do
    if ((SECONDS > deadline)); then e2e_say "$1: no line matching '$3' in $2 after ${WAIT}s"; return 1; fi
    for pid in "${PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || { e2e_say "a server exited early (pid $pid)"; return 1; }
    done
    sleep 1
  done
  echo "$line"
}

# interop_matrix_run: the second half of run_interop_test.sh and run_tp_test.sh.
# With the connector instances started (associative arrays PORT and SIDE keyed
# prefill-KIND / decode-KIND, array COMBOS of PREFILL-DECODE kinds, MODEL,
# SUMMARY set), it starts the aggregated baseline and one gonixl-proxy per
# combination, waits for everything (READY_S: seconds until ready), describes
# them in GONIXL_INTEROP_TOPOLOGY and runs tests/e2e/test_interop.py.
interop_matrix_run() {
  local c inst
  e2e_baseline
  declare -gA PROXY
  for c in "${COMBOS[@]}"; do
    PROXY[$c]=$(free_port)
    start_proxy "proxy-$c" "${PROXY[$c]}" "${PORT[prefill-${c%-*}]}" "${PORT[decode-${c#*-}]}"
  done
  e2e_say "model $MODEL; combinations ${COMBOS[*]}; instances ${!PORT[*]} + baseline; logs in $LOGS"
  for c in "${COMBOS[@]}"; do wait_ready "proxy-$c" "http://127.0.0.1:${PROXY[$c]}/healthcheck"; done
  for inst in "${!PORT[@]}"; do wait_ready "$inst" "http://127.0.0.1:${PORT[$inst]}/health"; done
  e2e_baseline_wait
  READY_S=$(e2e_elapsed)
  local topo
  topo=$(
    for inst in "${!PORT[@]}"; do printf 'I %s http://127.0.0.1:%s %s\n' "$inst" "${PORT[$inst]}" "$LOGS/$inst.log"; done
    for c in "${COMBOS[@]}"; do printf 'C %s http://127.0.0.1:%s %s\n' "$c" "${PROXY[$c]}" "$LOGS/proxy-$c.log"; done
  )
  GONIXL_INTEROP_TOPOLOGY=$(MODEL="$MODEL" BASELINE="$BASELINE_URL" "$PY" -c '
import json, os, sys
t = {"model": os.environ["MODEL"], "baseline": os.environ["BASELINE"], "instances": {}, "combos": {}}
for line in sys.stdin.read().splitlines():
    kind, name, url, *log = line.split(" ", 3)
    if kind == "I":
        t["instances"][name] = {"url": url, "log": log[0]}
    else:
        t["combos"][name] = {"proxy": url, "proxy_log": log[0]}
print(json.dumps(t))' <<<"$topo")
  export GONIXL_INTEROP_TOPOLOGY GONIXL_INTEROP_SUMMARY="$SUMMARY"
  e2e_pytest "$PY" -m pytest -q -rA -p no:cacheprovider "$ROOT/tests/e2e/test_interop.py"
}
