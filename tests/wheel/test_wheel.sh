#!/usr/bin/env bash
# Installs a gonixl wheel (./build.sh wheel builds it) with --no-deps into a
# fresh scratch venv, build/wheel-venv, and runs tests/wheel/check_wheel.py
# there: the package and libgonixl.so must come from that venv, and two
# connectors built from it must move KV between them.
#
# The scratch venv sees the packages of .venv (vLLM, torch, nixl) through a
# .pth file, added after the wheel is installed, so pip neither resolves
# anything nor finds the gonixl that ./build.sh build put in .venv; that copy
# comes after the venv's own site-packages on sys.path, and check_wheel.py
# asserts that it is not the one imported.
#
# Usage: tests/wheel/test_wheel.sh dist/gonixl-<version>-py3-none-<platform>.whl
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WHEEL="$(realpath "${1:?usage: $0 WHEEL}")"
VENV_PY="$ROOT/.venv/bin/python"
SCRATCH="$ROOT/build/wheel-venv"

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

[ -x "$VENV_PY" ] || { echo "test_wheel.sh: $VENV_PY is missing: run ./build.sh setup" >&2; exit 1; }
log "wheel: install $(basename "$WHEEL") into build/wheel-venv"
rm -rf "$SCRATCH"
"$VENV_PY" -m venv --without-pip "$SCRATCH"
# .venv's pip installs into the scratch interpreter's environment.
"$VENV_PY" -m pip --python "$SCRATCH/bin/python" install -q --no-deps --no-index "$WHEEL"

site="$("$SCRATCH/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
venv_site="$("$VENV_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir (not a bare path) so that .venv's own .pth files apply too.
echo "import site; site.addsitedir('$venv_site')" > "$site/gonixl-test-venv.pth"

log "wheel: tests/wheel/check_wheel.py in build/wheel-venv"
cd "$ROOT"
env -u GONIXL_LIB_PATH -u PYTHONPATH "$SCRATCH/bin/python" tests/wheel/check_wheel.py "$WHEEL"
