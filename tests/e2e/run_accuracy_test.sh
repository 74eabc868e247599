#!/usr/bin/env bash
# End-to-end accuracy test: a prefill vLLM (kv_producer) and a decode vLLM
# (kv_consumer) with GoNixlConnector behind gonixl-proxy (toy mode), and an
# aggregated vLLM without any connector as the baseline, all on this
# machine with the tiny fixture model; then tests/e2e/test_accuracy.py.
#
# Every process started here is stopped on exit, also on failure.
# Environment knobs: GONIXL_E2E_LOGS (log folder), GONIXL_E2E_TIMEOUT
# (seconds to wait for the servers, default 600), GONIXL_E2E_ENGINE
# (transfer_engine: ucx, nixl or auto; default ucx).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
PROXY_BIN="$ROOT/build/bin/gonixl-proxy"
MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/tiny-copy-model}"
LOGS="${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs}"
WAIT="${GONIXL_E2E_TIMEOUT:-600}"
mkdir -p "$LOGS"
rm -f "$LOGS"/*.log

[ -x "$PY" ] || { echo "run_accuracy_test: .venv missing: run ./build.sh setup" >&2; exit 1; }
[ -x "$PROXY_BIN" ] || { echo "run_accuracy_test: $PROXY_BIN missing: run ./build.sh build" >&2; exit 1; }
[ -f "$MODEL/config.json" ] || { echo "run_accuracy_test: model fixture $MODEL missing" >&2; exit 1; }

# Ports come from below the kernel's ephemeral range: vLLM binds many
# internal sockets to OS-chosen ports, which could otherwise take a port
# between our probe and the server's bind.
free_port() {
  "$PY" - <<'PYEOF'
import random, socket
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    port = random.randrange(20000, max(20001, min(lo, 32768)))
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
}
P_PORT=$(free_port); D_PORT=$(free_port); A_PORT=$(free_port); X_PORT=$(free_port)
P_SIDE=$(free_port); D_SIDE=$(free_port)

PIDS=()
cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  done
  sleep 2
  for pid in "${PIDS[@]}"; do
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  done
  if [ $rc -ne 0 ]; then
    echo "run_accuracy_test: FAILED (rc=$rc); last lines of each log in $LOGS:" >&2
    for f in "$LOGS"/*.log; do
      echo "----- $f" >&2
      grep -v -E 'api_utils|launcher.py' "$f" | tail -n 25 >&2 || true
    done
  fi
  exit $rc
}
trap cleanup EXIT INT TERM

# vLLM on a CPU host: offline, eager, a bounded KV cache
# 256 MiB), float32 (the bfloat16 AMX attention kernel is not used; see
# docs/ENVIRONMENT.md), block size 32 (the CPU backend's minimum).
COMMON=(--model "$MODEL" --enforce-eager --dtype float32 --block-size 32 --max-model-len 1024 --kv-cache-memory-bytes 268435456
        --max-num-seqs 16)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
# Three engines share two cores: no core pinning and no OpenMP spin-waiting,
# or the engines' background threads (gonixl's handshakes among them) starve.
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE VLLM_CPU_OMP_THREADS_BIND=nobind

# The transfer engine: gonixl's UCX engine by default; GONIXL_E2E_ENGINE=nixl
# (or auto) runs NIXL. NIXL's progress thread used to spin a core per worker
# here and stall decodes ~30 s; gonixl now gives it a 1 ms delay
# (progress_thread_delay_us, docs/ENVIRONMENT.md).
kv_config() {
  printf '{"kv_connector":"GoNixlConnector","kv_connector_module_path":"gonixl.vllm","kv_role":"%s","kv_connector_extra_config":{"transfer_engine":"%s"}}' \
    "$1" "${GONIXL_E2E_ENGINE:-ucx}"
}

start() { # name port args...
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 &
  PIDS+=($!)
}

start prefill env VLLM_NIXL_SIDE_CHANNEL_PORT="$P_SIDE" "$PY" -m vllm.entrypoints.openai.api_server \
  "${COMMON[@]}" --port "$P_PORT" --kv-transfer-config "$(kv_config kv_producer)"
start decode env VLLM_NIXL_SIDE_CHANNEL_PORT="$D_SIDE" "$PY" -m vllm.entrypoints.openai.api_server \
  "${COMMON[@]}" --port "$D_PORT" --kv-transfer-config "$(kv_config kv_consumer)"
start baseline "$PY" -m vllm.entrypoints.openai.api_server "${COMMON[@]}" --port "$A_PORT"
start proxy "$PROXY_BIN" --host 127.0.0.1 --port "$X_PORT" \
  --prefiller-hosts 127.0.0.1 --prefiller-ports "$P_PORT" --decoder-hosts 127.0.0.1 --decoder-ports "$D_PORT"

wait_ready() { # name url
  local deadline=$((SECONDS + WAIT))
  until curl -sf -o /dev/null "$2"; do
    if ((SECONDS > deadline)); then echo "run_accuracy_test: $1 not ready after ${WAIT}s" >&2; return 1; fi
    for pid in "${PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "run_accuracy_test: a server exited early (pid $pid)" >&2; return 1; }
    done
    sleep 2
  done
  echo "run_accuracy_test: $1 ready" >&2
}
wait_ready proxy "http://127.0.0.1:$X_PORT/healthcheck"
wait_ready prefill "http://127.0.0.1:$P_PORT/health"
wait_ready decode "http://127.0.0.1:$D_PORT/health"
wait_ready baseline "http://127.0.0.1:$A_PORT/health"

export GONIXL_E2E_PROXY="http://127.0.0.1:$X_PORT" GONIXL_E2E_BASELINE="http://127.0.0.1:$A_PORT"
export GONIXL_E2E_PREFILL="http://127.0.0.1:$P_PORT" GONIXL_E2E_DECODE="http://127.0.0.1:$D_PORT"
export GONIXL_E2E_DECODE_LOG="$LOGS/decode.log" GONIXL_E2E_PREFILL_LOG="$LOGS/prefill.log" GONIXL_E2E_MODEL="$MODEL"
"$PY" -m pytest -q -rA -p no:cacheprovider "$ROOT/tests/e2e/test_accuracy.py"
