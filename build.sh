#!/usr/bin/env bash
# gonixl's single entry point. Run ./build.sh help for the subcommands.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
PY="$VENV/bin/python"
BUILD="$ROOT/build"
LIB="$BUILD/libgonixl.so"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pybridge/pyproject.toml)"
APT_PACKAGES=(libucx0 ucx-utils libucx-dev python3-venv binutils)
PYTHON_BIN="${GONIXL_PYTHON:-python3.11}"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'build.sh: %s\n' "$*" >&2; exit 1; }

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
  local stamp="$VENV/.gonixl-requirements.sha256"
  local want
  want="$(sha256sum requirements.lock | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "pip install --no-deps -r requirements.lock (first run downloads about 4 GB)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q --no-deps -r requirements.lock
    echo "$want" > "$stamp"
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
  [ -x "$PY" ] || die ".venv is missing: run ./build.sh setup"
  cp "$LIB" pybridge/gonixl/libgonixl.so
  log "pip install ./pybridge into .venv"
  "$PY" -m pip install -q --no-deps --force-reinstall ./pybridge
  rm -rf pybridge/build pybridge/*.egg-info
}

## test: everything CI runs (setup and build first)
cmd_test() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  log "go vet ./..."
  go vet ./...
  log "go test ./..."
  go test -count=1 -timeout 15m ./...
  log "ABI check: exported symbols vs include/gonixl.h vs ctypes prototypes"
  "$PY" tests/abi_check.py "$LIB" include/gonixl.h
  log "pytest tests/python"
  "$PY" -m pytest -q -ra tests/python
  # End to end with real vLLM (slow on 2 cores: a few minutes each).
  # tests/e2e/stock_nixl_pd.sh measures vLLM's own connector; it is a
  # reference run, not part of CI.
  local t
  for t in tests/e2e/vllm_smoke.sh tests/e2e/run_accuracy_test.sh; do
    log "e2e: $t"
    bash "$t"
  done
  # The same accuracy run over the UCX engine's shared-memory data path
  # (the prefill's KV cache re-backed by a memfd that the decode maps).
  log "e2e: tests/e2e/run_accuracy_test.sh with GONIXL_UCX_DATA_PATH=shm"
  GONIXL_UCX_DATA_PATH=shm bash tests/e2e/run_accuracy_test.sh
  # And over real NIXL (transfer_engine nixl, its progress thread with the
  # shim's 1 ms delay; docs/ENVIRONMENT.md).
  log "e2e: tests/e2e/run_accuracy_test.sh with GONIXL_E2E_ENGINE=nixl"
  GONIXL_E2E_ENGINE=nixl bash tests/e2e/run_accuracy_test.sh
  # Real model geometries, and interop with vLLM's stock NixlConnector in
  # both directions (stock prefill -> gonixl decode, gonixl prefill -> stock
  # decode, and gonixl on both sides), each against the aggregated baseline:
  # a 28-layer GQA Llama (layer order: layers.10 after layers.9) and a
  # hybrid model with sliding-window and full-attention KV-cache groups.
  local m
  for m in llama-28l-gqa hybrid-swa; do
    log "e2e: tests/e2e/run_interop_test.sh on tests/fixtures/geometry/$m"
    GONIXL_E2E_MODEL="tests/fixtures/geometry/$m" GONIXL_E2E_LOGS="tests/e2e/logs/interop-$m" \
      bash tests/e2e/run_interop_test.sh
  done
  # The soak's short version: load through the proxy with disconnects and
  # aborts, then every live count (transfer handles, leases, handshakes)
  # back to zero and vLLM's KV-cache usage back to idle on both sides.
  log "e2e: tests/e2e/run_soak_test.sh (short)"
  GONIXL_SOAK_REQUESTS="${GONIXL_SOAK_REQUESTS:-500}" bash tests/e2e/run_soak_test.sh
  # Process faults: a decode paused past the lease, a READ to a frozen
  # prefill, the prefill killed and restarted, a decode killed (its blocks
  # freed at lease expiry), untrusted kv_transfer_params straight to a
  # decode; under both kv_load_failure_policy values.
  log "e2e: tests/e2e/run_faults_test.sh"
  bash tests/e2e/run_faults_test.sh
  # Several hosts as network namespaces (skips, saying why, without root).
  log "e2e: tests/e2e/run_netns_test.sh"
  bash tests/e2e/run_netns_test.sh
}

## soak: the long soak (2,000 requests at 32 concurrent) and the multi-host namespace test
cmd_soak() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  log "soak: tests/e2e/run_soak_test.sh"
  GONIXL_SOAK_REQUESTS="${GONIXL_SOAK_REQUESTS:-2000}" GONIXL_SOAK_CONCURRENCY="${GONIXL_SOAK_CONCURRENCY:-32}" \
    bash tests/e2e/run_soak_test.sh
  log "soak: tests/e2e/run_netns_test.sh"
  bash tests/e2e/run_netns_test.sh
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
  GONIXL_FUZZ_EXAMPLES="${GONIXL_FUZZ_EXAMPLES:-5000}" "$PY" -m pytest -q tests/python/test_fuzz_scheduler.py
}

## demo: the main job (setup and build first)
cmd_demo() {
  cmd_setup
  cmd_build
  export GONIXL_LIB_PATH="$LIB"
  "$PY" tests/demo.py
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
    setup | build | test | demo | soak | fuzz | help) "cmd_$sub" "$@" ;;
    *) cmd_help >&2; die "unknown subcommand: $sub" ;;
  esac
}

main "$@"
