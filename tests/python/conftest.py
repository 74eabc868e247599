import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def lib_path() -> str:
    """The library under test: GONIXL_LIB_PATH (./build.sh test sets it) or build/."""
    p = os.environ.get("GONIXL_LIB_PATH") or str(ROOT / "build" / "libgonixl.so")
    if not os.path.exists(p):
        pytest.fail(f"libgonixl.so not found at {p}: run ./build.sh build")
    return p
