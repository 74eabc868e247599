import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "tests"))
import testreport


def pytest_runtest_logreport(report):
    """Every skip and xfail goes to the step's report (tests/testreport.py):
    ./build.sh test fails on one that tests/declared.toml does not declare."""
    testreport.pytest_logreport(report)


@pytest.fixture(scope="session")
def lib_path() -> str:
    """The library under test: GONIXL_LIB_PATH (./build.sh test sets it) or build/."""
    p = os.environ.get("GONIXL_LIB_PATH") or str(ROOT / "build" / "libgonixl.so")
    if not os.path.exists(p):
        pytest.fail(f"libgonixl.so not found at {p}: run ./build.sh build")
    return p


@pytest.fixture(scope="session", autouse=True)
def no_live_objects_at_the_end():
    """The run ends with every scheduler and worker handle closed and no
    parked result left in the library this process loaded (tests that use
    the library in child processes check their own)."""
    yield
    from gonixl import _lib, live_objects

    if not _lib.is_loaded():
        return
    left = live_objects()
    assert left == {"schedulers": 0, "workers": 0, "pending_results": 0}, f"left open at the end of the run: {left}"
