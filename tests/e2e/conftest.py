"""pytest configuration of the end-to-end tests (run by the run_*_test.sh scripts)."""

import os
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import testreport


def pytest_runtest_logreport(report):
    """Every skip and xfail goes to the step's report (tests/testreport.py):
    ./build.sh test fails on one that tests/declared.toml does not declare."""
    testreport.pytest_logreport(report)
