#!/usr/bin/env bash
# gonixl's single entry point. Run ./build.sh help for the subcommands.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
PY="$VENV/bin/python"
VENV_STAMP="$VENV/.gonixl-requirements.sha256"
BUILD="$ROOT/build"
LIB="$BUILD/libgonixl.so"
DIST="$ROOT/dist"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pybridge/pyproject.toml)"
APT_PACKAGES=(libucx0 ucx-utils libucx-dev python3-venv binutils clang-format redis-server)
PYTHON_BIN="${GONIXL_PYTHON:-python3.11}"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'build.sh: %s\n' "$*" >&2; exit 1; }

lock_hash() { sha256sum "$ROOT/requirements.lock" | cut -d' ' -f1; }
# venv_current: .venv exists and holds what requirements.lock lists.
venv_current() { [ -x "$PY" ] && [ -f "$VENV_STAMP" ] && [ "$(cat "$VENV_STAMP")" = "$(lock_hash)" ]; }
require_venv() {
  [ -x "$PY" ] || die ".venv is missing: run ./build.sh setup"
  venv_current || die ".venv does not match requirements.lock: run ./build.sh setup"
}

## setup: install what a fresh machine lacks (apt packages, .venv, Go modules); idempotent
cmd_setup() {
  command -v go >/dev/null || die "Go is not installed (need go >= $(sed -n 's/^go //p' go.mod))"
  command -v "$PYTHON_BIN" >/dev/null || PYTHON_BIN=python3
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  if [ ! -x "$PY" ]; then
    log "creating $VENV"
    "$PYTHON_BIN" -m venv "$VENV"
  fi
  if ! venv_current; then
    log "pip install --no-deps -r requirements.lock (first run downloads about 4 GB)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q --no-deps -r requirements.lock
    lock_hash > "$VENV_STAMP"
  fi
  # The vllm command (tools/vllm-cli) over the CPU build's script, which
  # dies asking for the "vllm" distribution's version (README, "Pointing
  # vLLM at gonixl"); again whenever pip put the wheel's script back.
  if ! grep -q gonixl_vllm_cli "$VENV/bin/vllm" 2>/dev/null; then
    log "pip install ./tools/vllm-cli into .venv (the vllm command)"
    "$PY" -m pip install -q --no-deps --no-build-isolation --force-reinstall ./tools/vllm-cli
    rm -rf tools/vllm-cli/build tools/vllm-cli/*.egg-info
  fi
  log "go mod download"
  go mod download
}

## build: libgonixl.so (c-shared), the Go commands, and the Python package into .venv
cmd_build() {
  mkdir -p "$BUILD/bin"
  log "go build -buildmode=c-shared -o $LIB ./capi"
  go build -buildmode=c-shared -trimpath \
    -ldflags "-X github.com/gonixl/gonixl/shim.Version=$VERSION" -o "$LIB" ./capi
  rm -f "$BUILD/libgonixl.h" # include/gonixl.h is the contract, not cgo's generated header
  local c
  for c in cmd/*/; do
    c="${c%/}"
    go build -trimpath -o "$BUILD/bin/$(basename "$c")" "./$c"
  done
  require_venv
  cp "$LIB" pybridge/gonixl/libgonixl.so
  log "pip install ./pybridge into .venv"
  # Built with .venv's setuptools (pinned in requirements.lock), not a
  # freshly downloaded one.
  "$PY" -m pip install -q --no-deps --no-build-isolation --force-reinstall ./pybridge
  rm -rf pybridge/build pybridge/*.egg-info
  # The vLLM plugin that keeps async scheduling on for the CPU platform in
  # the end-to-end steps that set GONIXL_TEST_ASYNC_SCHEDULING=1 (inert
  # without it).
  if [ -d tests/vllm_async_plugin ]; then
    log "pip install ./tests/vllm_async_plugin into .venv"
    "$PY" -m pip install -q --no-deps --no-build-isolation ./tests/vllm_async_plugin
    rm -rf tests/vllm_async_plugin/build tests/vllm_async_plugin/*.egg-info
  fi
}

# Packages whose code or tests need cgo: capi and tests/cabi are the C ABI
# and its harness; nixl/libnixl's tests do not compile without it;
# cmd/gonixl-bench builds, but its tests drive the real engines. Every other
# package must build and pass its tests with CGO_ENABLED=0 (nixl/ucx then
# compiles its stub engine).
NEEDS_CGO=(capi nixl/libnixl tests/cabi cmd/gonixl-bench)

# SUBJECTS_SINCE: commits after this one keep their subject within 72
# characters, the why in the body (CONTRIBUTING.md); older history is left
# as it is.
SUBJECTS_SINCE=8a53e06
commit_subjects() {
  [ -d "$ROOT/.git" ] || [ -f "$ROOT/.git" ] || return 0 # an unpacked source tree: no history
  log "commit subjects <= 72 characters (since $SUBJECTS_SINCE)"
  local range="$SUBJECTS_SINCE..HEAD" long
  if ! git -C "$ROOT" cat-file -e "$SUBJECTS_SINCE^{commit}" 2>/dev/null; then
    # A shallow clone (CI may take one): the commits it has.
    log "commit $SUBJECTS_SINCE is not in this clone's history (shallow): checking the commits it has"
    range=HEAD
  fi
  long="$(git -C "$ROOT" log --no-merges --format='%h %s' "$range" | awk 'length($0) - index($0, " ") > 72')"
  [ -z "$long" ] || die "commit subjects over 72 characters (CONTRIBUTING.md; put the detail in the body): $long"
}

## check: gofmt, clang-format, go vet, go mod tidy, ruff and mypy on pybridge, Go tests without cgo
cmd_check() {
  require_venv
  local mod pkgs=() dirs=() p c skip
  mod="$(go list -m)"
  mapfile -t dirs < <(go list -f '{{.Dir}}' ./...)
  log "gofmt -l"
  local unformatted
  unformatted="$(gofmt -l "${dirs[@]}")"
  if [ -n "$unformatted" ]; then
    gofmt -d "${dirs[@]}" >&2 || true
    die "gofmt would change: $(echo "$unformatted" | sed "s|^$ROOT/||" | tr '\n' ' ')"
  fi
  log "clang-format --dry-run (the C files, .clang-format)"
  clang-format --dry-run -Werror nixl/ucx/gxucx.c nixl/ucx/gxshm.c nixl/ucx/gxucx.h nixl/ucx/gxcuda.c nixl/ucx/gxcuda.h \
    nixl/libnixl/gxnixl.c nixl/libnixl/gxnixl.h || die "clang-format would change the C files: run clang-format -i on them"
  log "go vet ./..."
  go vet ./...
  commit_subjects
  log "go mod tidy -diff"
  go mod tidy -diff || die "go.mod/go.sum are not tidy: run go mod tidy"
  log "ruff check (pybridge)"
  (cd pybridge && "$VENV/bin/ruff" check --quiet --cache-dir "$BUILD/ruff-cache" gonixl)
  # mypy reads vLLM and torch from .venv, so the connector is checked
  # against vLLM's own classes: 1-3 minutes on 2 cores while
  # build/mypy-cache is empty, seconds after.
  log "mypy (pybridge)"
  (cd pybridge && "$PY" -m mypy --cache-dir "$BUILD/mypy-cache")
  while read -r p; do
    skip=""
    for c in "${NEEDS_CGO[@]}"; do [ "$p" = "$mod/$c" ] && skip=1; done
    [ -n "$skip" ] || pkgs+=("$p")
  done < <(go list ./...)
  log "CGO_ENABLED=0 go test (${#pkgs[@]} packages; not ${NEEDS_CGO[*]})"
  CGO_ENABLED=0 go_test -count=1 -timeout 15m "${pkgs[@]}"
}

# go_test ARGS...: go test -json ARGS, printed as plain go test prints it
# (and a line per skipped test) by tests/testreport.py, which records every
# skip in the step's report when ./build.sh test runs it (the raw JSON is
# kept next to the report).
go_test() {
  if [ -n "${GONIXL_TEST_REPORT:-}" ]; then
    go test -json "$@" | tee -a "${GONIXL_TEST_REPORT%.jsonl}.go.json" | "$PYTHON_BIN" tests/testreport.py go
  else
    go test -json "$@" | "$PYTHON_BIN" tests/testreport.py go
  fi
}

# cgo_packages: the packages whose build differs with cgo: those with cgo
# files and those that import one (tests included). check tested every
# other package already (with CGO_ENABLED=0, which builds them the same).
cgo_packages() {
  local p
  for p in $(go list ./...); do
    if go list -test -deps -f '{{if .CgoFiles}}{{.ImportPath}}{{end}}' "$p" | grep -q "^$(go list -m)/"; then
      echo "$p"
    fi
  done
}

# unit_tests: Go tests, the C ABI check and pytest tests/python against the
# library in build/ (no vLLM servers).
unit_tests() {
  export GONIXL_LIB_PATH="$LIB"
  log "go test ./..."
  go_test -count=1 -timeout 15m ./...
  abi_check
  pytest_unit
}
abi_check() {
  log "ABI check: exported symbols vs include/gonixl.h vs ctypes prototypes"
  "$PY" tests/abi_check.py "$LIB" include/gonixl.h
}
pytest_unit() {
  log "pytest tests/python"
  "$PY" -m pytest -q -ra tests/python
}

## test-fast: build, then Go tests, ABI check and pytest tests/python (no vLLM servers)
cmd_test_fast() {
  cmd_build
  unit_tests
}

# wheel_platform SO: the manylinux platform tag a wheel holding SO may
# claim: x86-64, nothing linked but glibc's own libraries, and the newest
# glibc symbol version SO uses.
wheel_platform() {
  local so="$1" n glibc
  objdump -f "$so" | grep -q 'architecture: i386:x86-64' || die "$so is not an x86-64 library"
  for n in $(objdump -p "$so" | awk '$1 == "NEEDED" {print $2}'); do
    case "$n" in
      libc.so.6 | libm.so.6 | libpthread.so.0 | libdl.so.2 | librt.so.1 | ld-linux-x86-64.so.2) ;;
      *) die "$so links $n, which manylinux does not provide" ;;
    esac
  done
  glibc="$(objdump -T "$so" | grep -o 'GLIBC_[0-9]*\.[0-9]*' | sort -uV | tail -n1)"
  [ -n "$glibc" ] || die "$so uses no versioned glibc symbol"
  glibc="${glibc#GLIBC_}"
  echo "manylinux_${glibc%%.*}_${glibc#*.}_x86_64"
}

# build_wheel: dist/gonixl-VERSION-py3-none-PLATFORM.whl from pybridge/ with
# the libgonixl.so that cmd_build copied there; sets WHEEL to its path.
build_wheel() {
  local plat whl
  plat="$(wheel_platform "$LIB")"
  cmp -s "$LIB" pybridge/gonixl/libgonixl.so || die "pybridge/gonixl/libgonixl.so is not $LIB: run ./build.sh build"
  mkdir -p "$DIST"
  rm -f "$DIST"/gonixl-*.whl
  log "pip wheel ./pybridge -> dist/ ($plat)"
  # The package is Python plus a ctypes-loaded library (no CPython
  # extension): any Python 3, no ABI, one platform.
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIST" \
    --config-settings=--build-option=--plat-name="$plat" ./pybridge
  rm -rf pybridge/build pybridge/*.egg-info
  whl="$DIST/gonixl-$VERSION-py3-none-$plat.whl"
  [ -f "$whl" ] || die "pip wheel did not write $whl (dist/: $(ls "$DIST"))"
  "$PY" - "$whl" "$LIB" <<'PYEOF' || die "$whl does not hold the library just built"
import sys, zipfile
whl, lib = sys.argv[1:]
with zipfile.ZipFile(whl) as z, open(lib, "rb") as f:
    names = set(z.namelist())
    assert {"gonixl/libgonixl.so", "gonixl/py.typed", "gonixl/vllm.py"} <= names, sorted(names)
    assert z.read("gonixl/libgonixl.so") == f.read()
PYEOF
  WHEEL="$whl"
}

## wheel: build dist/gonixl-*.whl (libgonixl.so inside), install it in a scratch venv and test it
cmd_wheel() {
  cmd_build
  build_wheel
  bash tests/wheel/test_wheel.sh "$WHEEL"
  log "built ${WHEEL#"$ROOT"/}"
}

# ---------------------------------------------------------------- test runs
#
# ./build.sh test and test-full run a list of steps. Each step runs in a
# subshell with GONIXL_TEST_REPORT naming its report file under
# build/test-report/: every skip (pytest, go test, the end-to-end scripts'
# e2e_skip) and every retried first try is recorded there, and when the step
# ends tests/testreport.py checks the report against tests/declared.toml and
# prints the step's line: result, seconds, the load average at its end,
# skips and retries. An undeclared skip, more retries than declared or a
# non-zero exit fails the step, and the run stops there. A summary table of
# the steps closes the run, on success and on failure.

REPORT="$BUILD/test-report"

# stallwatch_start: tests/e2e/stallwatch.py in the background for the rest
# of the run; at exit its lines (times the machine gave a process no CPU for
# 5 s or more) and the kernel's lockup reports are printed last, where a
# failure's reader looks.
stallwatch_start() {
  local out="$ROOT/build/stalls.txt"
  : >"$out"
  "$PY" tests/e2e/stallwatch.py "$out" "$REPORT/vllm-instances.txt" &
  STALLWATCH_PID=$!
  STALLWATCH_UPTIME0=$(cut -d' ' -f1 /proc/uptime)
}
stallwatch_report() {
  [ -n "${STALLWATCH_PID:-}" ] || return 0
  kill "$STALLWATCH_PID" 2>/dev/null || true
  local out="$ROOT/build/stalls.txt" k
  # The kernel's reports since the run began (dmesg stamps seconds since boot).
  k=$(dmesg 2>/dev/null | grep -E "workqueue lockup|rcu_preempt detected stalls|soft lockup" |
    awk -v t0="$STALLWATCH_UPTIME0" '{ t = $0; sub(/^\[ */, "", t); sub(/\].*/, "", t); if (t + 0 >= t0 + 0) print }' | tail -5 || true)
  if [ -s "$out" ] || [ -n "$k" ]; then
    printf '\nmachine stalls during the run (a process that got no CPU for 5 s or more):\n' >&2
    tail -n 20 "$out" >&2
    [ -z "$k" ] || printf 'kernel (dmesg, seconds since boot; now %s):\n%s\n' "$(cut -d' ' -f1 /proc/uptime)" "$k" >&2
  fi
}

# run_begin NAME: a run of steps; its report folder emptied, the exit trap
# set (shared baselines and the stall watcher stopped, the table printed).
run_begin() {
  RUN_NAME=$1
  RUN_T0=$SECONDS
  rm -rf "$REPORT"
  mkdir -p "$REPORT"
  : >"$REPORT/summary.jsonl"
  export GONIXL_LIB_PATH="$LIB"
  trap run_end EXIT
}
run_end() {
  local rc=$?
  trap - EXIT
  [ -z "${FAILED_STEP:-}" ] || [ "$rc" -ne 0 ] || rc=1
  baseline_end
  stallwatch_report
  "$PYTHON_BIN" tests/testreport.py table --summary "$REPORT/summary.jsonl" >&2 || true
  local m=$(((SECONDS - RUN_T0) / 60)) s=$(((SECONDS - RUN_T0) % 60))
  [ -z "${GONIXL_TEST_STEPS:-}" ] || printf 'only the steps GONIXL_TEST_STEPS=%s selects ran: not a full run\n' "$GONIXL_TEST_STEPS" >&2
  if [ "$rc" -eq 0 ]; then
    printf '\033[1m./build.sh %s: passed in %d min %d s\033[0m\n' "$RUN_NAME" "$m" "$s" >&2
  else
    printf '\033[1m./build.sh %s: FAILED%s after %d min %d s (exit %d)\033[0m\n' "$RUN_NAME" \
      "${FAILED_STEP:+ in step $FAILED_STEP}" "$m" "$s" "$rc" >&2
  fi
  exit "$rc"
}

# step NAME CMD...: one step of the run (CMD: a function of this file or a
# command, in a subshell with errexit; its exports do not outlive it).
# GONIXL_TEST_STEPS (a glob, or several separated by commas) runs only the
# steps whose names match, for working on a few: not a full run.
step() {
  local name=$1 rep t0=$SECONDS rc=0 g sel=""
  shift
  if [ -n "${GONIXL_TEST_STEPS:-}" ]; then
    IFS=',' read -r -a _globs <<<"$GONIXL_TEST_STEPS"
    for g in "${_globs[@]}"; do
      # shellcheck disable=SC2053
      [[ $name == $g ]] && sel=1
    done
    [ -n "$sel" ] || return 0
  fi
  [[ $name != e2e-* ]] || baseline_start_pending
  rep="$REPORT/$name.jsonl"
  : >"$rep"
  local epoch0
  epoch0=$(date +%s.%N)
  log "step $name: $* ($(date -u +%H:%M:%S), load average $(cut -d' ' -f1-3 /proc/loadavg))"
  (
    export GONIXL_TEST_REPORT="$rep" GONIXL_TEST_STEP="$name"
    "$@"
  ) &
  wait $! || rc=$?
  "$PYTHON_BIN" tests/testreport.py check --step "$name" --report "$rep" --rc "$rc" --seconds $((SECONDS - t0)) \
    --load "$(cut -d' ' -f1-3 /proc/loadavg)" --summary "$REPORT/summary.jsonl" \
    ${STALLWATCH_PID:+--instances "$REPORT/vllm-instances.txt" --t0 "$epoch0"} || {
    FAILED_STEP="${FAILED_STEP:+$FAILED_STEP, }$name"
    # GONIXL_TEST_KEEP_GOING=1: the next steps still run (the run fails at
    # the end), to see every failure of a change in one run.
    [ "${GONIXL_TEST_KEEP_GOING:-0}" = 1 ] || exit 1
  }
}

# e2e SCRIPT [VAR=VALUE...]: an end-to-end script with that environment.
e2e() {
  local script=$1
  shift
  env "$@" bash "$script"
}

# baseline_begin MODEL: tests/e2e/baseline_cache.py for MODEL (its
# aggregated vLLM and the answers it gave), shared by the steps after it
# through GONIXL_E2E_SHARED_BASELINE (tests/e2e/lib.sh's e2e_baseline), until
# baseline_end or the next baseline_begin. baseline_cache_only stops its
# vLLM: the steps after it get remembered answers only.
baseline_begin() {
  baseline_end
  # Started by the first step of the model that runs (all of them in a full
  # run; a run narrowed by GONIXL_TEST_STEPS may need none).
  BASELINE_PENDING=$1
}
baseline_start_pending() {
  [ -n "${BASELINE_PENDING:-}" ] || return 0
  local model=$BASELINE_PENDING f="$REPORT/baseline.url"
  BASELINE_PENDING=
  rm -f "$f"
  GONIXL_E2E_LOGS="$ROOT/tests/e2e/logs/baseline-$(basename "$model")" \
    "$PY" tests/e2e/baseline_cache.py "$model" "$f" >>"$REPORT/baseline-$(basename "$model").log" 2>&1 &
  BASELINE_PID=$!
  until [ -s "$f" ]; do
    kill -0 "$BASELINE_PID" 2>/dev/null || die "tests/e2e/baseline_cache.py exited: $(tail -n 20 "$REPORT/baseline-$(basename "$model").log")"
    sleep 0.2
  done
  GONIXL_E2E_SHARED_BASELINE=$(cat "$f")
  export GONIXL_E2E_SHARED_BASELINE GONIXL_E2E_SHARED_BASELINE_MODEL="$model"
  log "shared baseline of $(basename "$model"): $GONIXL_E2E_SHARED_BASELINE (log $REPORT/baseline-$(basename "$model").log)"
}
baseline_cache_only() {
  # Not started yet (GONIXL_TEST_STEPS left out the steps before): it keeps
  # its vLLM, since nothing has been remembered.
  [ -n "${BASELINE_PID:-}" ] || return 0
  log "shared baseline of $(basename "$GONIXL_E2E_SHARED_BASELINE_MODEL"): its vLLM stopped, remembered answers only"
  curl -sf -X POST "$GONIXL_E2E_SHARED_BASELINE/_baseline/cache_only" >&2 || die "the shared baseline did not switch to cache only"
}
baseline_end() {
  BASELINE_PENDING=
  [ -n "${BASELINE_PID:-}" ] || return 0
  kill -TERM "$BASELINE_PID" 2>/dev/null || true
  wait "$BASELINE_PID" 2>/dev/null || true
  BASELINE_PID=
  unset GONIXL_E2E_SHARED_BASELINE GONIXL_E2E_SHARED_BASELINE_MODEL
}

# The unit steps: Go tests of the packages check did not test (cgo), the C
# ABI check, pytest, the wheel.
step_go_cgo() {
  local pkgs
  mapfile -t pkgs < <(cgo_packages)
  log "go test (${#pkgs[@]} packages whose build differs with cgo; check tested the rest)"
  go_test -count=1 -timeout 15m "${pkgs[@]}"
}
step_wheel() {
  # The wheel, installed in a scratch venv, loads its own library and moves
  # KV between two connectors.
  build_wheel
  bash tests/wheel/test_wheel.sh "$WHEEL"
}

TINY="$ROOT/tests/fixtures/tiny-copy-model"
LLAMA="$ROOT/tests/fixtures/geometry/llama-28l-gqa"
HYBRID="$ROOT/tests/fixtures/geometry/hybrid-swa"
# The steps that run vLLM's async scheduling on the CPU platform (the
# tests/vllm_async_plugin plugin, installed by cmd_build; without it the
# variable changes nothing).
ASYNC=GONIXL_TEST_ASYNC_SCHEDULING=1

## test: everything CI runs (setup, check and build first; 17-24 min on a fresh clone here, README)
cmd_test() {
  run_begin test
  step setup cmd_setup
  step check cmd_check
  step build cmd_build
  stallwatch_start
  step go-cgo step_go_cgo
  step abi abi_check
  # GONIXL_FUZZ_STRICT=1: the Hypothesis suite fails on every bug class it
  # finds, none tolerated (a known bug is fixed or fails the build).
  step pytest env GONIXL_FUZZ_STRICT=1 "$PY" -m pytest -q -ra tests/python
  step wheel step_wheel

  # End to end with real vLLM: every feature at least once, at most three
  # vLLM instances alive at a time (four in the fault suite). A shared
  # aggregated baseline per model (baseline_begin) is one of the three; the
  # model's steps that need their three for themselves come after
  # baseline_cache_only. ./build.sh test-full runs the rest of the matrix.
  baseline_begin "$TINY"
  # Pull over gonixl's UCX engine, with the shared-memory data path (the
  # prefill's KV cache re-backed by a memfd that the decode maps).
  step e2e-pull-ucx-shm e2e tests/e2e/run_accuracy_test.sh GONIXL_UCX_DATA_PATH=shm $ASYNC \
    GONIXL_E2E_LOGS=tests/e2e/logs/pull-ucx-shm
  # Pull over real NIXL (transfer_engine nixl, its progress thread with the
  # shim's 1 ms delay; docs/ENVIRONMENT.md), with a decode block size of 64
  # against the prefill's 32: each decode block is read as two prefill
  # blocks and put in the CPU kernel's token order.
  step e2e-pull-nixl-bs64 e2e tests/e2e/run_accuracy_test.sh GONIXL_E2E_ENGINE=nixl GONIXL_E2E_DECODE_BLOCK_SIZE=64 $ASYNC \
    GONIXL_E2E_LOGS=tests/e2e/logs/pull-nixl-bs64
  # The README's main job (./build.sh demo): a prefill and a decode started
  # with `vllm serve` as vLLM's disaggregated-serving guide does, requests
  # through gonixl-proxy, then `vllm bench serve` through it (8 of 8 must
  # succeed).
  step e2e-demo "$PY" tests/demo.py
  # Bidirectional KV transfer: multi-turn conversations through
  # gonixl-proxy --multiturn, the prefill pulling the history back from the
  # decode (prompt_tokens_by_source proves it computed only the new tokens),
  # an edited history limited by the decode's token digest; one prefill and
  # one decode (test-full: two of each, and with stock peers).
  step e2e-multiturn e2e tests/e2e/run_multiturn_test.sh GONIXL_MT_FLEET=1x1 $ASYNC
  # The soak's short version: load through the proxy with disconnects and
  # aborts, then every live count (transfer handles, leases, handshakes)
  # back to zero and vLLM's KV-cache usage back to idle on both sides.
  step e2e-soak e2e tests/e2e/run_soak_test.sh GONIXL_SOAK_REQUESTS="${GONIXL_SOAK_REQUESTS:-500}"
  # Process faults: a decode paused past the lease, a READ to a frozen
  # prefill, the prefill killed and restarted, a decode killed (its blocks
  # freed at lease expiry), untrusted kv_transfer_params straight to a
  # decode; under both kv_load_failure_policy values.
  step e2e-faults e2e tests/e2e/run_faults_test.sh
  # Several hosts as network namespaces: two prefills and a decode, each in
  # its own namespace, KV over TCP (test-full: two decodes and a link cut).
  # It computes its baseline first (from the shared one), then switches it
  # off for its three instances.
  step e2e-netns e2e tests/e2e/run_netns_test.sh GONIXL_NETNS_FLEET=2x1
  baseline_end

  # The 28-layer GQA Llama (layer order: layers.10 after layers.9).
  baseline_begin "$LLAMA"
  # Interop with vLLM's stock NixlConnector (gonixl over NIXL): a gonixl
  # prefill read by a stock decode (a stock prefill read by a gonixl decode:
  # e2e-tp-hybrid-stock below), against the aggregated baseline, which then
  # remembers the prompts of the later steps (all 24 of the same list, or
  # its first 12).
  step e2e-interop-go-stock e2e tests/e2e/run_interop_test.sh GONIXL_E2E_MODEL="$LLAMA" GONIXL_INTEROP_COMBOS=go-stock \
    GONIXL_E2E_LOGS=tests/e2e/logs/interop-go-stock
  # Block ownership under KV-cache pressure with async scheduling on (the
  # GPU default; tests/vllm_async_plugin keeps it on here): small KV pools
  # and chunked prefill so that both sides preempt, clients that abandon,
  # traffic straight at the prefill; pull and push, gonixl on both sides
  # (test-full adds stock peers). Every completed output equals the
  # baseline's, preemptions grew on both sides, every live gauge back to
  # zero. gonixl-proxy still hands a request whose client left after its
  # prefill to the decode (--abandon-grace), whose connector frees the
  # prefill's blocks at once; without that such a hold would keep the step
  # waiting for its 120 s lease.
  step e2e-pressure e2e tests/e2e/run_pressure_test.sh GONIXL_E2E_MODEL="$LLAMA" $ASYNC GONIXL_PRESSURE_CONFIGS=pull:go-go,push:go-go
  baseline_cache_only
  # Push mode (vLLM's NixlPushConnector protocol: the decode registers its
  # blocks, the prefill WRITEs into them; gonixl-proxy --push sends both
  # requests at once), gonixl on both sides over gonixl's UCX engine.
  step e2e-push e2e tests/e2e/run_interop_test.sh GONIXL_E2E_MODEL="$LLAMA" GONIXL_INTEROP_PUSH=1 \
    GONIXL_INTEROP_COMBOS=go-go GONIXL_INTEROP_GO_ENGINE=ucx $ASYNC GONIXL_E2E_LOGS=tests/e2e/logs/push-ucx
  # Tensor and data parallelism with real vLLM (its CPU backend runs TP = 2
  # with one worker process per rank), on the GQA Llama (2 KV heads: head
  # slicing): a TP-1 prefill read by a TP-2 decode and by a decode with
  # --data-parallel-size 2; a TP-2 prefill read by a TP-1 decode.
  step e2e-tp-1to2-dp e2e tests/e2e/run_tp_test.sh GONIXL_E2E_MODEL="$LLAMA" GONIXL_TP_COMBOS=ux1-ux2,ux1-dp2 \
    GONIXL_E2E_LOGS=tests/e2e/logs/tp-1to2-dp
  step e2e-tp-2to1 e2e tests/e2e/run_tp_test.sh GONIXL_E2E_MODEL="$LLAMA" GONIXL_TP_COMBOS=ux2-ux1 \
    GONIXL_E2E_LOGS=tests/e2e/logs/tp-2to1
  baseline_end

  # The hybrid model (sliding-window and full-attention KV-cache groups,
  # 1 KV head): a stock NixlConnector prefill at TP 2, whose replicated head
  # a gonixl decode at TP 1 reads once (vLLM's own decode refuses that
  # pairing); then a gonixl prefill at TP 2 (its sliding-window groups send
  # only their in-window blocks) read by a gonixl decode at TP 1 over the
  # UCX engine (the duplicate rank notified, not read).
  baseline_begin "$HYBRID"
  step e2e-tp-hybrid-stock e2e tests/e2e/run_tp_test.sh GONIXL_E2E_MODEL="$HYBRID" GONIXL_TP_COMBOS=stock2-go1 \
    GONIXL_E2E_LOGS=tests/e2e/logs/tp-hybrid-stock
  baseline_cache_only
  step e2e-tp-hybrid-2to1 e2e tests/e2e/run_tp_test.sh GONIXL_E2E_MODEL="$HYBRID" GONIXL_TP_COMBOS=ux2-ux1 \
    GONIXL_E2E_LOGS=tests/e2e/logs/tp-hybrid-2to1
  baseline_end
}

## test-full: what ./build.sh test leaves out: the full interop, push and TP matrices, multi-turn 2+2 and with stock peers, the netns link cut, the router, pressure in pull mode and with stock peers, the fleet (about 35 min)
cmd_test_full() {
  run_begin test-full
  step setup cmd_setup
  step build cmd_build
  stallwatch_start

  baseline_begin "$TINY"
  # Real vLLM (CPU) serves the tiny fixture at all.
  step e2e-smoke e2e tests/e2e/vllm_smoke.sh
  # Pull over gonixl's UCX engine with its default data path (cma).
  step e2e-pull-ucx e2e tests/e2e/run_accuracy_test.sh $ASYNC GONIXL_E2E_LOGS=tests/e2e/logs/pull-ucx
  # Multi-turn with two prefills and two decodes (a turn's prefill may pull
  # from another pairing's decode), then with vLLM's stock NixlConnector in
  # the fleet (a gonixl and a stock prefill, a stock and a gonixl decode).
  step e2e-multiturn-2x2 e2e tests/e2e/run_multiturn_test.sh GONIXL_MT_FLEET=2x2 $ASYNC
  # (decoder_kv_blocks_ttl 120 s: a stock decode's expiry is checked only at
  # the READ, which fails the turn under kv_load_failure_policy fail; at load
  # 50 a turn waited past 40 s. The idle-conversation test that needs a
  # short TTL does not run with stock peers.)
  step e2e-multiturn-interop e2e tests/e2e/run_multiturn_test.sh GONIXL_MT_INTEROP=1 GONIXL_MT_TTL=120 $ASYNC
  # Behind vllm-router's P/D mode (its own request flow and ids).
  step e2e-router e2e tests/e2e/run_router_test.sh
  baseline_end
  # Two prefills, two decodes, each in its own network namespace, and p0's
  # link cut mid-stream and restored.
  step e2e-netns-2x2 e2e tests/e2e/run_netns_test.sh GONIXL_NETNS_FLEET=2x2

  # The interop matrices on both models: gonixl on both sides, stock
  # prefill -> gonixl decode, gonixl prefill -> stock decode, each against
  # the aggregated baseline.
  baseline_begin "$LLAMA"
  step e2e-interop-llama e2e tests/e2e/run_interop_test.sh GONIXL_E2E_MODEL="$LLAMA" \
    GONIXL_E2E_LOGS=tests/e2e/logs/interop-llama-28l-gqa
  # Push: gonixl on both sides and with the stock push connector on either
  # side, over NIXL (a stock push prefill's first request waits for its own
  # P->D handshake: 86 s once on this loaded VM, within test_interop.py's
  # 300 s per request).
  step e2e-push-matrix e2e tests/e2e/run_interop_test.sh GONIXL_E2E_MODEL="$LLAMA" GONIXL_INTEROP_PUSH=1 \
    $ASYNC GONIXL_E2E_LOGS=tests/e2e/logs/push
  # TP 2 -> 2 (each decode rank reads the same rank of the prefill).
  step e2e-tp-2to2 e2e tests/e2e/run_tp_test.sh GONIXL_E2E_MODEL="$LLAMA" GONIXL_TP_COMBOS=ux2-ux2 \
    GONIXL_E2E_LOGS=tests/e2e/logs/tp-2to2
  baseline_end
  baseline_begin "$HYBRID"
  step e2e-interop-hybrid e2e tests/e2e/run_interop_test.sh GONIXL_E2E_MODEL="$HYBRID" \
    GONIXL_E2E_LOGS=tests/e2e/logs/interop-hybrid-swa
  # The rest of the hybrid TP set over gonixl's UCX engine (1 KV head < TP 2:
  # replicated heads; ux2-ux1 is in ./build.sh test), one combination per
  # run (a TP-2 vLLM's workers spin on its shared-memory broadcast; the
  # whole matrix up at once starved the VM).
  step e2e-tp-hybrid-1to2 e2e tests/e2e/run_tp_test.sh GONIXL_E2E_MODEL="$HYBRID" GONIXL_TP_COMBOS=ux1-ux2 \
    GONIXL_E2E_LOGS=tests/e2e/logs/tp-hybrid-1to2
  baseline_end
  # Block ownership under pressure against vLLM's stock connectors on
  # either side (./build.sh test runs pull and push, gonixl on both
  # sides). Not push with a stock
  # prefill: vLLM's push prefill has no admission of unclaimed requests
  # (docs/ARCHITECTURE.md, "Push under KV-cache pressure"), so its holds and
  # the decode's allocations can wait on each other until a timeout.
  step e2e-pressure-stock e2e tests/e2e/run_pressure_test.sh GONIXL_E2E_MODEL="$LLAMA" $ASYNC \
    GONIXL_PRESSURE_CONFIGS=pull:stock-go,pull:go-stock,push:go-stock GONIXL_E2E_LOGS=tests/e2e/logs/pressure-stock
  # The fleet (README, "Fleet"): two gonixl-proxy replicas sharing their
  # multi-turn state in redis-server, one restarted mid-conversation; the
  # decodes' KV events; vllm-router's cache_aware prefill policy against
  # round_robin. Five vLLMs at once: too many for ./build.sh test.
  step e2e-fleet e2e tests/e2e/run_fleet_test.sh
}

## soak: the long soak (2,000 requests at 32 concurrent), the multi-host namespace test and the pressure case at 4x load
cmd_soak() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  log "soak: tests/e2e/run_soak_test.sh"
  GONIXL_SOAK_REQUESTS="${GONIXL_SOAK_REQUESTS:-2000}" GONIXL_SOAK_CONCURRENCY="${GONIXL_SOAK_CONCURRENCY:-32}" \
    bash tests/e2e/run_soak_test.sh
  log "soak: tests/e2e/run_netns_test.sh"
  bash tests/e2e/run_netns_test.sh
  # Block ownership under KV-cache pressure, four times ./build.sh test's
  # load, pull and push, gonixl on both sides and with a stock peer.
  log "soak: tests/e2e/run_pressure_test.sh (async scheduling on, 4x the load)"
  GONIXL_TEST_ASYNC_SCHEDULING=1 GONIXL_PRESSURE_REQUESTS="${GONIXL_PRESSURE_REQUESTS:-96}" \
    GONIXL_PRESSURE_ABANDON="${GONIXL_PRESSURE_ABANDON:-64}" GONIXL_PRESSURE_FRESH="${GONIXL_PRESSURE_FRESH:-64}" \
    GONIXL_PRESSURE_CONFIGS="${GONIXL_PRESSURE_CONFIGS:-pull:go-go,push:go-go,pull:stock-go,pull:go-stock,push:go-stock}" \
    GONIXL_E2E_LOGS=tests/e2e/logs/pressure-soak bash tests/e2e/run_pressure_test.sh
}

## fuzz: every Go fuzz target for GONIXL_FUZZTIME each (default 10m), and a long Hypothesis run
cmd_fuzz() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  local t="${GONIXL_FUZZTIME:-10m}" pkg name
  while read -r pkg name; do
    log "fuzz: $pkg $name for $t"
    go test -run '^$' -fuzz "^${name}\$" -fuzztime "$t" -parallel "${GONIXL_FUZZ_PARALLEL:-1}" "$pkg"
  done < <(grep -rl --include='*_test.go' '^func Fuzz' . | grep -v '^./.venv' | while read -r f; do
    sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$f" | sed "s|^|./$(dirname "${f#./}") |"
  done)
  log "fuzz: Hypothesis on the scheduler entry points (GONIXL_FUZZ_EXAMPLES=${GONIXL_FUZZ_EXAMPLES:-5000})"
  # Strict: every bug class Hypothesis finds fails the run (none tolerated).
  GONIXL_FUZZ_STRICT=1 GONIXL_FUZZ_EXAMPLES="${GONIXL_FUZZ_EXAMPLES:-5000}" "$PY" -m pytest -q tests/python/test_fuzz_scheduler.py
  # The block-ownership model (shim/model_test.go): random interleavings of
  # vLLM's and the peer's events, every invariant checked after each
  # (./build.sh test draws 300 runs).
  log "fuzz: the block-ownership model, GONIXL_MODEL_RUNS=${GONIXL_MODEL_RUNS:=20000} runs"
  GONIXL_MODEL_RUNS=$GONIXL_MODEL_RUNS go test -count=1 -run '^TestModelOwnership$' -timeout 60m ./shim
}

## test-router: prefill and decode vLLM with GoNixlConnector behind vllm-router's P/D mode, against the aggregated baseline
cmd_test_router() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  bash tests/e2e/run_router_test.sh
}

## bench-multiturn: bidirectional KV transfer on vs off, one multi-turn workload (docs/BENCHMARKS.md)
cmd_bench_multiturn() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  bash bench/run_multiturn_bench.sh
}

## bench-push: TTFT and hand-off, push vs pull, gonixl and stock (docs/BENCHMARKS.md)
cmd_bench_push() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  bash bench/run_vllm_bench.sh push
}

## bench [PART...]: gonixl vs vLLM's stock NixlConnector, side by side (docs/BENCHMARKS.md); PART: vllm, first-contact, go (default: vllm)
cmd_bench() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  local parts=("$@") part
  ((${#parts[@]})) || parts=(vllm)
  for part in "${parts[@]}"; do
    case "$part" in
      # Real vLLM instances, stock and gonixl through one timing wrapper.
      vllm) bash bench/run_vllm_bench.sh connector ;;
      # First contact with an 80-layer registration: the stock worker's own
      # code on real NIXL, then gonixl's Go benchmarks, in one session.
      first-contact) "$PY" bench/stock_first_contact.py --gonixl --json docs/data/first-contact/stock_first_contact.json ;;
      # The hot paths' Go microbenchmarks (docs/BENCHMARKS.md).
      go)
        go test -run '^$' -bench 'ReadDescIDs|StepMeta|ParseNotif|PollNotifs|LeaseSweep|GetFinishedIdle' -benchmem ./shim/
        go test -run '^$' -bench 'Handshake80L|AgentMetadata' -benchmem ./sidechannel/
        ;;
      *) die "bench: unknown part $part (vllm, first-contact, go)" ;;
    esac
  done
}

## demo: the main job (setup and build first)
cmd_demo() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  "$PY" tests/demo.py
}

## gpu-bundle: .gpu/ (git-ignored): what the GPU host lacks, to carry with libgonixl.so (tests/gpu/README.md)
cmd_gpu_bundle() {
  cmd_build
  local dir="$ROOT/.gpu" deb tmp
  mkdir -p "$dir/ucx"
  tmp="$(mktemp -d)"
  # Debian's UCX and its one hard dependency, unpacked (not installed):
  # the GPU host's image has no libucp, and gonixl's ucx engine carries
  # its notifications (the data moves by CUDA IPC).
  (cd "$tmp" && apt-get download libucx0 libnuma1 >/dev/null 2>&1) || die "apt-get download libucx0 libnuma1 failed"
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$dir/ucx"; done
  rm -rf "$tmp"
  grep -qx '/.gpu/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >>"$ROOT/.git/info/exclude"
  log "gpu-bundle: $(du -sh "$dir" | cut -f1) in .gpu; carry .gpu and pybridge/gonixl/libgonixl.so, run tests/gpu/run.sh"
}

## help: this text
cmd_help() {
  echo "usage: ./build.sh <subcommand>"
  echo
  grep -E '^## ' "$0" | sed 's/^## /  /'
}

main() {
  local sub="${1:-help}"
  shift || true
  case "$sub" in
    setup | build | check | test | demo | soak | fuzz | wheel | help) "cmd_$sub" "$@" ;;
    test-fast) cmd_test_fast "$@" ;;
    test-full) cmd_test_full "$@" ;;
    test-router) cmd_test_router "$@" ;;
    gpu-bundle) cmd_gpu_bundle "$@" ;;
    bench-multiturn) cmd_bench_multiturn "$@" ;;
    bench-push) cmd_bench_push "$@" ;;
    bench) cmd_bench "$@" ;;
    *) cmd_help >&2; die "unknown subcommand: $sub" ;;
  esac
}

main "$@"
