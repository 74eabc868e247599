#!/usr/bin/env bash
# Reference run of vLLM's own (stock) NixlConnector on this host: one prefill instance
# (kv_producer) and one decode instance (kv_consumer) with the tiny fixture model, driven by a
# manual proxy flow (P with do_remote_decode and max_tokens=1, then D with P's kv_transfer_params).
# This is the set-up gonixl's GoNixlConnector is measured against; it is not part of the gonixl
# test suite.
#
#   tests/e2e/stock_nixl_pd.sh                  # 16 prompts, sequential
#   PD_PROMPTS=64 PD_EXTRA='{"num_threads":1}' tests/e2e/stock_nixl_pd.sh
#
# Knobs: PYTHON, PD_PROMPTS (16), PD_EXTRA (kv_connector_extra_config JSON, default {}),
# STARTUP_TIMEOUT (300 s), SERVER_LIFETIME (900 s), KEEP_LOG=1.
# Prints per-request P and D latencies, the answers, and the "KV Transfer metrics" lines of D.
# Exit status 0 only if every scored answer matches the key, D's metrics report as many
# successful transfers as there were prompts that needed one, and no transfer failed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
MODEL="$REPO/tests/fixtures/tiny-copy-model"
PD_PROMPTS="${PD_PROMPTS:-16}"
PD_EXTRA="${PD_EXTRA:-{\}}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-300}"
SERVER_LIFETIME="${SERVER_LIFETIME:-900}"
BLOCK_SIZE=32

[[ -x "$PYTHON" ]] || { echo "stock_nixl_pd: no python at $PYTHON" >&2; exit 2; }
WORK="$(mktemp -d /tmp/stock-nixl-pd.XXXXXX)"
PGIDS=()
STATUS=1

cleanup() {
    local g
    for g in "${PGIDS[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
    for _ in $(seq 1 30); do
        local alive=0
        for g in "${PGIDS[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
        (( alive )) || break
        sleep 0.5
    done
    for g in "${PGIDS[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
    if [[ $STATUS -ne 0 ]]; then
        for f in "$WORK"/*.log; do
            echo "---- last lines of $f" >&2
            tail -n 25 "$f" >&2 || true
        done
    fi
    if [[ "${KEEP_LOG:-0}" == 1 ]]; then echo "stock_nixl_pd: logs kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# /health probe in Python, so the script needs no HTTP client from apt.
healthy() {
    "$PYTHON" -c 'import sys, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
except Exception:
    sys.exit(1)' "http://127.0.0.1:$1/health"
}

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start() { # role http_port side_channel_port log
    local cfg
    cfg="{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"$1\",\"kv_buffer_device\":\"cpu\",\"kv_connector_extra_config\":$PD_EXTRA}"
    echo "stock_nixl_pd: $1 on 127.0.0.1:$2, side channel $3, --kv-transfer-config '$cfg'"
    # VLLM_RPC_BASE_PATH: vLLM's ZeroMQ ipc sockets go to the work dir (removed on exit), not /tmp.
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_RPC_BASE_PATH="$WORK" \
    VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT="$3" \
        setsid timeout -k 10 "$SERVER_LIFETIME" "$PYTHON" -m vllm.entrypoints.openai.api_server \
        --model "$MODEL" --served-model-name tiny --host 127.0.0.1 --port "$2" \
        --dtype float32 --enforce-eager --max-model-len 1024 --block-size "$BLOCK_SIZE" \
        --kv-cache-memory-bytes 268435456 --max-num-seqs 16 \
        --kv-transfer-config "$cfg" >"$4" 2>&1 &
    PGIDS+=("$!")
}

P_PORT=$(free_port); D_PORT=$(free_port); P_SIDE=$(free_port); D_SIDE=$(free_port)
T0=$(date +%s)
start kv_producer "$P_PORT" "$P_SIDE" "$WORK/prefill.log"
start kv_consumer "$D_PORT" "$D_SIDE" "$WORK/decode.log"
for port in "$P_PORT" "$D_PORT"; do
    until healthy "$port"; do
        for g in "${PGIDS[@]}"; do
            kill -0 "$g" 2>/dev/null || { echo "stock_nixl_pd: a server exited during startup" >&2; exit 1; }
        done
        (( $(date +%s) - T0 > STARTUP_TIMEOUT )) && { echo "stock_nixl_pd: startup timeout" >&2; exit 1; }
        sleep 1
    done
done
echo "stock_nixl_pd: both healthy after $(( $(date +%s) - T0 ))s"

P_PORT=$P_PORT D_PORT=$D_PORT N=$PD_PROMPTS BLOCK=$BLOCK_SIZE FIXTURES="$REPO/tests/fixtures" \
    "$PYTHON" - >"$WORK/flow.out" <<'EOF' || { cat "$WORK/flow.out"; exit 1; }
import json, os, sys, time, urllib.request, uuid
sys.path.insert(0, os.environ["FIXTURES"])
import model_task

P, D, n = int(os.environ["P_PORT"]), int(os.environ["D_PORT"]), int(os.environ["N"])

def post(port, body, rid):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": rid})
    t = time.time()
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r), time.time() - t

exs = model_task.examples(2024, model_task.eval_lengths(n, 2024, block_size=int(os.environ["BLOCK"])))
pairs, transfers = [], 0
for ex in exs:
    rid = str(uuid.uuid4())
    body = {"model": "tiny", "prompt": ex.prompt, "max_tokens": 1, "temperature": 0.0,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                   "remote_engine_id": None, "remote_block_ids": None,
                                   "remote_host": None, "remote_port": None}}
    pr, pt = post(P, body, rid)
    kvp = pr.get("kv_transfer_params") or {}
    body = {"model": "tiny", "prompt": ex.prompt, "max_tokens": model_task.MAX_KEY_LEN + 1,
            "temperature": 0.0, "kv_transfer_params": kvp}
    dr, dt = post(D, body, rid)
    out = dr["choices"][0]["text"]
    pairs.append((ex, out))
    # Every prompt of 2 or more tokens needs its KV from P (vLLM even counts the 1-token one).
    transfers += int(len(ex.prompt) >= 2)
    print(f"len={len(ex.prompt):4d} P={pt:6.2f}s D={dt:6.2f}s want={ex.answer!r:10} "
          f"got={out!r:12} P_first={pr['choices'][0]['text']!r} remote_blocks={kvp.get('remote_block_ids')}",
          flush=True)
c, s = model_task.accuracy(pairs)
print(f"ACCURACY {c}/{s}")
print(f"EXPECTED_MIN_TRANSFERS {transfers}")
EOF
cat "$WORK/flow.out"
sleep 12   # D logs its KV transfer metrics every 10 s
echo "stock_nixl_pd: decode-side metrics:"
grep "KV Transfer metrics" "$WORK/decode.log" | sed 's/^.*KV Transfer metrics/KV Transfer metrics/' || true
grep -h "expired\|Potentially invalid\|NIXL transfer failure" "$WORK/prefill.log" "$WORK/decode.log" | cut -c1-240 || true

read -r c s < <(sed -n 's#^ACCURACY \([0-9]*\)/\([0-9]*\)$#\1 \2#p' "$WORK/flow.out")
sum_metric() { { grep "KV Transfer metrics" "$WORK/decode.log" || true; } | sed -n "s/.*$1=\([0-9]*\).*/\1/p" | awk '{s+=$1} END {print s+0}'; }
ok=$(sum_metric "Num successful transfers")
failed=$(sum_metric "Num failed transfers")
want=$(sed -n 's/^EXPECTED_MIN_TRANSFERS //p' "$WORK/flow.out")
echo "stock_nixl_pd: accuracy $c/$s, successful transfers ${ok:-0} (expected >= $want), failed ${failed:-0}"
if [[ "$c" == "$s" && "${ok:-0}" -ge "$want" && "${failed:-0}" == 0 ]]; then
    STATUS=0
    echo "stock_nixl_pd: OK"
else
    echo "stock_nixl_pd: FAILED" >&2
    exit 1
fi
