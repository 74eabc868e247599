#!/usr/bin/env bash
# End-to-end fault test: real vLLM processes, real faults (SIGSTOP, SIGKILL,
# a frozen READ peer, a restarted prefill, untrusted kv_transfer_params), and
# what gonixl promises under each; then tests/e2e/test_faults.py.
#
#   bash tests/e2e/run_faults_test.sh
#   GONIXL_FAULTS_CASES='untrusted or pause' bash tests/e2e/run_faults_test.sh   # a subset (pytest -k)
#
# Started here (at most four vLLM processes at once, for a 2-core machine):
#   prefill           kv_producer, GoNixlConnector, a small KV cache (so that
#                     other traffic overwrites freed blocks soon); its params
#                     carry KV digests (kv_digest fail, the default)
#   decode-fail       kv_consumer, kv_load_failure_policy "fail"
#   decode-recompute  kv_consumer, kv_load_failure_policy "recompute"
#                     (both decodes with GONIXL_TEST_KV_FAULT=1: case f's damaged READs)
#   baseline          aggregated vLLM without a connector
#   proxy-fail, proxy-recompute   gonixl-proxy (toy mode): prefill -> that decode
# All gonixl instances get kv_lease_duration, transfer_timeout and
# handshake_timeout from the knobs below. test_faults.py restarts the prefill
# (same HTTP and side-channel ports) and kills a decode; every process group it
# starts is written to $LOGS/extra_pgids and stopped on exit here as well, and
# every group is sent SIGCONT before it is stopped (a case may have paused it).
#
# Environment knobs:
#   GONIXL_E2E_LOGS              log folder (default tests/e2e/logs/faults)
#   GONIXL_E2E_TIMEOUT           seconds to wait for a server to be ready (600)
#   GONIXL_E2E_MODEL             model folder (default tests/fixtures/tiny-copy-model)
#   GONIXL_E2E_ENGINE            transfer_engine (default ucx)
#   GONIXL_UCX_DATA_PATH         the ucx engine's data path (default here ucp, not the engine's
#                                default cma: cases b and d need READs that wait on the prefill's
#                                progress, so that a READ is in flight when the prefill is killed
#                                or frozen; with cma the decode copies by itself and such a READ
#                                completes, correctly, before the fault lands)
#   UCX_TLS                      default here ^cma,tcp: UCX's own CMA lane (rma_bw) serves a
#                                ucp_get one-sided too, for descriptors above its zero-copy
#                                threshold (contiguous blocks coalesce into such descriptors,
#                                so it depends on where the prefill's allocator put them); the
#                                READ then completes from a stopped prefill in milliseconds
#                                (seen in case b: 0.03 s, correct). Without CMA every same-host
#                                READ is served by the peer's progress, as cases b and d need.
#                                Without tcp too (^cma,tcp): UCX 1.13.1's TCP transport crashes a
#                                process in its progress (uct_tcp_iface_progress, SIGSEGV) on a
#                                first transfer now and then; with ^cma the RMA lanes are tcp and
#                                the prefill's worker died in 3 of 7 runs of this suite. Measured
#                                with gonixl-bench transfer (docs/environment-ucx.md): 14 of 120
#                                runs with tcp lanes, 0 of 60 without, 0 of 60 with UCX 1.22.
#   GONIXL_FAULTS_LEASE          kv_lease_duration, seconds (4)
#   GONIXL_FAULTS_TRANSFER_TIMEOUT  transfer_timeout, seconds (10)
#   GONIXL_FAULTS_HANDSHAKE_TIMEOUT handshake_timeout, seconds (5)
#   GONIXL_FAULTS_PREFILL_KV_BYTES  the prefill's --kv-cache-memory-bytes (8 MiB: 128 blocks
#                                of the tiny model)
#   GONIXL_FAULTS_CASES          pytest -k expression selecting cases (default: all)
#   GONIXL_LIB_PATH              which libgonixl.so the vLLM processes load (pybridge's knob)
set -euo pipefail

E2E_NAME=run_faults_test
# shellcheck source=tests/e2e/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODEL="${GONIXL_E2E_MODEL:-$ROOT/tests/fixtures/tiny-copy-model}"
e2e_logs "${GONIXL_E2E_LOGS:-$ROOT/tests/e2e/logs/faults}"
e2e_require "$MODEL"
e2e_vllm_args "$MODEL"
ENGINE="${GONIXL_E2E_ENGINE:-ucx}"
export GONIXL_UCX_DATA_PATH="${GONIXL_UCX_DATA_PATH:-ucp}"
export UCX_TLS="${UCX_TLS:-^cma,tcp}"
LEASE="${GONIXL_FAULTS_LEASE:-4}"
TRANSFER_TIMEOUT="${GONIXL_FAULTS_TRANSFER_TIMEOUT:-10}"
HANDSHAKE_TIMEOUT="${GONIXL_FAULTS_HANDSHAKE_TIMEOUT:-5}"
PREFILL_KV_BYTES="${GONIXL_FAULTS_PREFILL_KV_BYTES:-8388608}"
SUMMARY="$LOGS/summary.txt"
EXTRA_PGIDS="$LOGS/extra_pgids"
: >"$SUMMARY"
: >"$EXTRA_PGIDS"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)

# Process groups started by test_faults.py (the restarted prefill): stopped
# like lib.sh stops its own. Called by lib.sh's exit trap.
e2e_at_exit() {
  local pg _ alive
  if [ -s "$EXTRA_PGIDS" ]; then
    while read -r pg; do
      [ -n "$pg" ] || continue
      kill -CONT -- "-$pg" 2>/dev/null || true
      kill -TERM -- "-$pg" 2>/dev/null || true
    done <"$EXTRA_PGIDS"
    for _ in $(seq 1 25); do
      alive=0
      while read -r pg; do [ -n "$pg" ] && kill -0 -- "-$pg" 2>/dev/null && alive=1; done <"$EXTRA_PGIDS"
      ((alive)) || break
      sleep 0.2
    done
    while read -r pg; do [ -n "$pg" ] && { kill -KILL -- "-$pg" 2>/dev/null || true; }; done <"$EXTRA_PGIDS"
  fi
  [ -s "$SUMMARY" ] && cat "$SUMMARY" >&2
  e2e_say "$([ "$1" -eq 0 ] && echo passed || echo "FAILED (rc=$1)") in $(e2e_elapsed) s (servers ready after ${READY_S:-n/a} s; load average at start $LOAD0, now $(cut -d' ' -f1-3 /proc/loadavg))"
}
# A case may leave a group paused (SIGSTOP) if the test itself dies: resume
# every group before lib.sh's cleanup sends SIGTERM (a stopped process would
# only die at the SIGKILL 5 s later). errexit off first: e2e_cleanup must run
# with the exit status in $?.
faults_cont_all() {
  local pid
  for pid in "${PIDS[@]}"; do kill -CONT -- "-$pid" 2>/dev/null || true; done
}
trap 'rc=$?; set +e; faults_cont_all; (exit $rc); e2e_cleanup' EXIT

# kv_config ROLE [POLICY]: GoNixlConnector with the fault-test timings.
kv_config() {
  local policy=""
  [ $# -ge 2 ] && policy=$(printf ',"kv_load_failure_policy":"%s"' "$2")
  printf '{"kv_connector":"GoNixlConnector","kv_connector_module_path":"gonixl.vllm","kv_role":"%s"%s,"kv_connector_extra_config":{"transfer_engine":"%s","kv_lease_duration":%s,"transfer_timeout":%s,"handshake_timeout":%s}}' \
    "$1" "$policy" "$ENGINE" "$LEASE" "$TRANSFER_TIMEOUT" "$HANDSHAKE_TIMEOUT"
}

# vLLM's HTTP keep-alive (uvicorn, 5 s by default) longer than any pause
# here and than gonixl-proxy's idle-connection timeout (90 s). With the
# default, a connection the proxy left idle just before a SIGSTOP carries the
# next request into the paused server, and on SIGCONT uvloop runs the
# expired keep-alive timer before it reads that request: the connection is
# reset and the proxy answers 502, an HTTP-layer artefact of the pause that
# has nothing to do with the KV transfer under test.
export VLLM_HTTP_TIMEOUT_KEEP_ALIVE=120

P_PORT=$(free_port); P_SIDE=$(free_port)
DF_PORT=$(free_port); DF_SIDE=$(free_port)
DR_PORT=$(free_port); DR_SIDE=$(free_port)
XF_PORT=$(free_port); XR_PORT=$(free_port)

# The prefill's command line, kept so that the test can start it again on the
# same ports. A smaller KV cache than the others (the last
# --kv-cache-memory-bytes wins): blocks a lapsed lease frees are reused soon.
P_CMD=(env VLLM_NIXL_SIDE_CHANNEL_PORT="$P_SIDE" "$PY" -m vllm.entrypoints.openai.api_server
       "${COMMON[@]}" --kv-cache-memory-bytes "$PREFILL_KV_BYTES" --port "$P_PORT"
       --kv-transfer-config "$(kv_config kv_producer)")
start prefill "${P_CMD[@]}"
P_PGID=${PIDS[-1]}
# The decodes damage READs of requests named for it (case f, shim/kvfault.go).
export GONIXL_TEST_KV_FAULT=1
start_vllm decode-fail "$DF_PORT" "$DF_SIDE" "$(kv_config kv_consumer fail)"
DF_PGID=${PIDS[-1]}
start_vllm decode-recompute "$DR_PORT" "$DR_SIDE" "$(kv_config kv_consumer recompute)"
DR_PGID=${PIDS[-1]}
unset GONIXL_TEST_KV_FAULT
e2e_baseline
start_proxy proxy-fail "$XF_PORT" "$P_PORT" "$DF_PORT"
start_proxy proxy-recompute "$XR_PORT" "$P_PORT" "$DR_PORT"
e2e_say "model $MODEL, engine $ENGINE, lease ${LEASE}s, transfer_timeout ${TRANSFER_TIMEOUT}s, handshake_timeout ${HANDSHAKE_TIMEOUT}s, data path $GONIXL_UCX_DATA_PATH, UCX_TLS $UCX_TLS; logs in $LOGS"

wait_ready proxy-fail "http://127.0.0.1:$XF_PORT/healthcheck"
wait_ready proxy-recompute "http://127.0.0.1:$XR_PORT/healthcheck"
wait_ready prefill "http://127.0.0.1:$P_PORT/health"
wait_ready decode-fail "http://127.0.0.1:$DF_PORT/health"
wait_ready decode-recompute "http://127.0.0.1:$DR_PORT/health"
e2e_baseline_wait
READY_S=$(e2e_elapsed)

GONIXL_FAULTS_PREFILL_CMD=$("$PY" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${P_CMD[@]}")
export GONIXL_FAULTS_PREFILL_CMD GONIXL_FAULTS_PREFILL_PGID=$P_PGID
export GONIXL_FAULTS_PREFILL="http://127.0.0.1:$P_PORT" GONIXL_FAULTS_PREFILL_LOG="$LOGS/prefill.log"
export GONIXL_FAULTS_DECODE_FAIL="http://127.0.0.1:$DF_PORT" GONIXL_FAULTS_DECODE_FAIL_PGID=$DF_PGID
export GONIXL_FAULTS_DECODE_FAIL_LOG="$LOGS/decode-fail.log"
export GONIXL_FAULTS_DECODE_RECOMPUTE="http://127.0.0.1:$DR_PORT" GONIXL_FAULTS_DECODE_RECOMPUTE_PGID=$DR_PGID
export GONIXL_FAULTS_DECODE_RECOMPUTE_LOG="$LOGS/decode-recompute.log"
export GONIXL_FAULTS_PROXY_FAIL="http://127.0.0.1:$XF_PORT" GONIXL_FAULTS_PROXY_RECOMPUTE="http://127.0.0.1:$XR_PORT"
export GONIXL_FAULTS_BASELINE="$BASELINE_URL" GONIXL_FAULTS_MODEL="$MODEL"
export GONIXL_FAULTS_LEASE="$LEASE" GONIXL_FAULTS_TRANSFER_TIMEOUT="$TRANSFER_TIMEOUT"
export GONIXL_FAULTS_HANDSHAKE_TIMEOUT="$HANDSHAKE_TIMEOUT" GONIXL_FAULTS_READY_TIMEOUT="$WAIT"
export GONIXL_FAULTS_LOGS="$LOGS" GONIXL_FAULTS_SUMMARY="$SUMMARY" GONIXL_FAULTS_EXTRA_PGIDS="$EXTRA_PGIDS"

# The servers are stopped through PIDS by lib.sh; out of bash's job table,
# the groups the test kills on purpose are not reported as "Killed".
disown -a

K=()
[ -n "${GONIXL_FAULTS_CASES:-}" ] && K=(-k "$GONIXL_FAULTS_CASES")
e2e_pytest "$PY" -m pytest -q -rA -s -p no:cacheprovider "${K[@]}" "$ROOT/tests/e2e/test_faults.py"
