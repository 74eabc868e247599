"""What a test run skipped and retried, checked against tests/declared.toml.

./build.sh test runs each step (a Go test run, pytest, one end-to-end
script, ...) with GONIXL_TEST_REPORT naming a JSON-lines file of its own
under build/test-report/. Everything that skips or retries writes one line
there:

- pytest (tests/python/conftest.py, tests/e2e/conftest.py): every skipped
  or xfailed test, with its reason;
- go test: `go test -json` piped through `python tests/testreport.py go`,
  which prints what plain `go test` prints (plus a line per skipped test)
  and records every skipped test with its message;
- the end-to-end scripts: e2e_skip in tests/e2e/lib.sh (a SKIP line);
- retries: record_retry() below (tests/e2e/e2e_common.py re-exports it),
  one line per first try that failed and was tried again.

When the step ends, `python tests/testreport.py check` compares the file
with tests/declared.toml: a skip that no [[skip]] entry declares, or more
retries than the step's [[retries]] entry allows (none without one), fail
the step, and the step's summary line says what skipped and retried and
why. Without GONIXL_TEST_REPORT (a test run by hand) nothing is recorded;
pytest's own -rs line still lists the skips.

Standard library only: the end-to-end tests import it too.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECLARED = os.path.join(ROOT, "tests", "declared.toml")
ENV_REPORT = "GONIXL_TEST_REPORT"


def _append(record: dict) -> None:
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    record.setdefault("step", os.environ.get("GONIXL_TEST_STEP", ""))
    line = json.dumps(record, sort_keys=True) + "\n"
    # One write of one line in append mode: lines from concurrent writers
    # (pytest workers, threads of a test) do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def record_skip(runner: str, test_id: str, reason: str, kind: str = "skip") -> None:
    """A test that did not run (kind "skip") or ran as an expected failure ("xfail")."""
    _append({"kind": kind, "runner": runner, "id": test_id, "reason": reason})


def record_retry(what: str, why: str) -> None:
    """A first try (or a later one) that failed and is tried again: `what`
    names the try ("multi-turn warm-up: conversation warm-0"), `why` says
    what went wrong."""
    print(f"RETRY: {what}: {why}", file=sys.stderr, flush=True)
    _append({"kind": "retry", "id": what, "reason": why})


# ---------------------------------------------------------------- pytest


def record_failure(runner: str, test_id: str, reason: str) -> None:
    """A test that failed, with the first line of why: the run's last lines
    (all that a CI page may keep of a long log) repeat it."""
    _append({"kind": "fail", "runner": runner, "id": test_id, "reason": reason})


def _failure_reason(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", ""):
        return str(crash.message)
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else "(no message)"


def pytest_logreport(report) -> None:
    """Called from the conftest files' pytest_runtest_logreport hook."""
    if report.failed:
        record_failure("pytest", report.nodeid + ("" if report.when == "call" else f" ({report.when})"), _failure_reason(report))
        return
    if not report.skipped:
        return
    if hasattr(report, "wasxfail"):
        record_skip("pytest", report.nodeid, f"xfail: {report.wasxfail}", kind="xfail")
        return
    reason = ""
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        reason = str(lr[2])
    else:
        reason = str(lr)
    reason = reason.removeprefix("Skipped: ")
    record_skip("pytest", report.nodeid, reason)


# ---------------------------------------------------------------- go test -json


def go_filter(inp, out) -> None:
    """`go test -json` on inp -> what `go test` without -v prints, on out.

    A passing package is its "ok" line; a failing one also gets the output
    of its failed tests (and of tests still running when it failed: a
    timeout or a panic); each skipped test gets a line with its message and
    is recorded."""
    tests: dict[tuple[str, str], list[str]] = {}
    done: set[tuple[str, str]] = set()
    pkg_out: dict[str, list[str]] = {}

    def emit(text: str) -> None:
        out.write(text)
        out.flush()

    for raw in inp:
        raw = raw.strip()
        if not raw:
            continue
        try:
            ev = json.loads(raw)
        except ValueError:
            emit(raw + "\n")  # not JSON: go's own errors
            continue
        action, pkg, test = ev.get("Action"), ev.get("Package", ""), ev.get("Test", "")
        if action in ("build-output",):
            emit(ev.get("Output", ""))
            continue
        if action == "build-fail":
            continue
        key = (pkg, test)
        if action == "output":
            if test:
                tests.setdefault(key, []).append(ev.get("Output", ""))
            else:
                pkg_out.setdefault(pkg, []).append(ev.get("Output", ""))
            continue
        if not test:
            if action in ("pass", "skip"):
                # "ok  pkg 1.2s" or "?   pkg [no test files]"
                emit("".join(ln for ln in pkg_out.get(pkg, []) if ln.startswith(("ok", "?"))))
            elif action == "fail":
                for (p, t), lines in tests.items():
                    if p == pkg and (p, t) not in done:
                        emit("".join(lines))  # still running when the package failed
                        record_failure("go", f"{p}.{t}", "still running when the package failed (a timeout or a panic)")
                emit("".join(pkg_out.get(pkg, [])) or f"FAIL\t{pkg}\n")
            if action in ("pass", "skip", "fail"):
                pkg_out.pop(pkg, None)
                for k in [k for k in tests if k[0] == pkg]:
                    tests.pop(k, None)
                    done.discard(k)
            continue
        if action == "fail":
            done.add(key)
            emit("".join(tests.get(key, [])))
            said = [
                ln.strip()
                for ln in tests.get(key, [])
                if ln.strip() and not ln.startswith(("=== ", "--- FAIL", "--- PASS", "--- SKIP"))
            ]
            record_failure("go", f"{pkg}.{test}", " | ".join(said[:3]) or "(no output)")
        elif action == "pass":
            done.add(key)
        elif action == "skip":
            done.add(key)
            msg = " ".join(
                ln.strip()
                for ln in tests.get(key, [])
                if not ln.startswith(("=== ", "--- SKIP", "--- PASS", "--- FAIL")) and ln.strip()
            )
            emit(f"--- SKIP: {pkg} {test}: {msg}\n")
            record_skip("go", f"{pkg}.{test}", msg)


# ---------------------------------------------------------------- the check


def load_declared(path: str = DECLARED) -> dict:
    import tomllib

    with open(path, "rb") as f:
        d = tomllib.load(f)
    for s in d.get("skip", []):
        for k in ("step", "id", "message", "why"):
            if not s.get(k):
                raise SystemExit(f"{path}: a [[skip]] entry without {k!r}: {s}")
    for r in d.get("retries", []):
        for k in ("step", "max", "why"):
            if k not in r:
                raise SystemExit(f"{path}: a [[retries]] entry without {k!r}: {r}")
    return d


def declared_skip(declared: dict, step: str, rec: dict) -> dict | None:
    for s in declared.get("skip", []):
        if (
            fnmatch.fnmatchcase(step, s["step"])
            and fnmatch.fnmatchcase(rec.get("id", ""), s["id"])
            and re.search(s["message"], rec.get("reason", ""))
            and rec.get("kind") == "skip"  # an xfail is never declared: a known bug fails the build
        ):
            return s
    return None


def allowed_retries(declared: dict, step: str) -> tuple[int, str]:
    for r in declared.get("retries", []):
        if fnmatch.fnmatchcase(step, r["step"]):
            return int(r["max"]), r["why"]
    return 0, ""


def read_records(path: str) -> list[dict]:
    recs = []
    if os.path.exists(path):
        with open(path) as f:
            for ln in f:
                ln = ln.strip()
                if ln:
                    recs.append(json.loads(ln))
    return recs


def _short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def most_alive(instances: str, t0: float, t1: float) -> int | None:
    """The most vLLM instances alive between t0 and t1 (unix times), from
    tests/e2e/stallwatch.py's file of count changes; None without one."""
    if not instances or not os.path.exists(instances):
        return None
    most, current = 0, 0
    with open(instances) as f:
        for ln in f:
            try:
                t, c = float(ln.split()[0]), int(ln.split()[1])
            except (ValueError, IndexError):
                continue
            if t <= t0:
                current = c
            elif t <= t1:
                most = max(most, c)
    return max(most, current)


def check(step: str, report: str, rc: int, seconds: int, load: str, summary: str, alive: int | None = None) -> int:
    """Prints the step's summary line (and what skipped and retried); appends
    the step's row to summary; returns the step's exit status."""
    declared = load_declared()
    recs = read_records(report)
    skips = [r for r in recs if r.get("kind") in ("skip", "xfail")]
    retries = [r for r in recs if r.get("kind") == "retry"]
    failures = [r for r in recs if r.get("kind") == "fail"]
    undeclared = [r for r in skips if declared_skip(declared, step, r) is None]
    max_retries, why_retries = allowed_retries(declared, step)
    problems = []
    if rc != 0:
        problems.append(f"exit status {rc}")
    if undeclared:
        problems.append(f"{len(undeclared)} undeclared skip(s)")
    if len(retries) > max_retries:
        problems.append(f"{len(retries)} retries, {max_retries} allowed")
    result = "PASS" if not problems else "FAIL"
    lines = []
    for r in failures:
        lines.append(f"  FAILED {r.get('runner', '?')} {r.get('id')}: {_short(r.get('reason', ''), 600)}")
    for r in skips:
        d = declared_skip(declared, step, r)
        tag = "declared" if d else ("XFAIL (a tolerated bug)" if r.get("kind") == "xfail" else "UNDECLARED")
        lines.append(f"  skip [{tag}] {r.get('runner', '?')} {r.get('id')}: {_short(r.get('reason', ''))}")
    for r in retries:
        lines.append(f"  retry {r.get('id')}: {_short(r.get('reason', ''))}")
    why = {}
    for r in retries:
        k = _short(r.get("reason", ""), 60)
        why[k] = why.get(k, 0) + 1
    retry_text = f"{len(retries)} first tries failed (allowed {max_retries})" + (
        ": " + "; ".join(f"{n}x {k}" for k, n in why.items()) if why else ""
    )
    head = (
        f"step {step}: {result} in {seconds} s (load average at its end {load}"
        + (f"; at most {alive} vLLM instances alive" if alive is not None else "")
        + f"); skips {len(skips)} ({len(skips) - len(undeclared)} declared); {retry_text}"
    )
    if problems:
        head += " -- " + ", ".join(problems)
    print("\n".join(["", "\033[1m" + head + "\033[0m", *lines]), file=sys.stderr, flush=True)
    if undeclared:
        print(
            f"  an undeclared skip fails the run: make it run, or declare it with its reason in {os.path.relpath(DECLARED, ROOT)}",
            file=sys.stderr,
        )
    if len(retries) > max_retries:
        print(
            f"  more first tries failed than {os.path.relpath(DECLARED, ROOT)} expects for this step"
            + (f" ({why_retries})" if why_retries else ""),
            file=sys.stderr,
        )
    with open(summary, "a") as f:
        f.write(
            json.dumps(
                {
                    "step": step,
                    "seconds": seconds,
                    "load": load,
                    "result": result,
                    "skips": len(skips),
                    "undeclared": len(undeclared),
                    "retries": len(retries),
                    "max_retries": max_retries,
                    "vllm": alive,
                    "rc": rc,
                    "end": time.time(),
                    "failures": [f"{r.get('id')}: {_short(r.get('reason', ''), 600)}" for r in failures],
                }
            )
            + "\n"
        )
    return 0 if result == "PASS" else (rc or 1)


def table(summary: str, pending: list[str]) -> None:
    rows = read_records(summary)
    w = max([len(r["step"]) for r in rows] + [len(p) for p in pending] + [4])
    out = ["", f"{'step':<{w}}  {'seconds':>7}  {'load (1/5/15 min) at end':<24}  {'vLLMs':>5}  {'result':<6}  {'skips':<18}  retries"]
    total = 0
    for r in rows:
        total += r["seconds"]
        skips = f"{r['skips']}" + (f" ({r['undeclared']} undeclared)" if r["undeclared"] else "")
        alive = "" if r.get("vllm") is None else str(r["vllm"])
        out.append(
            f"{r['step']:<{w}}  {r['seconds']:>7}  {r['load']:<24}  {alive:>5}  {r['result']:<6}  {skips:<18}  {r['retries']} of {r['max_retries']} allowed"
        )
    for p in pending:
        out.append(f"{p:<{w}}  {'':>7}  {'':<24}  {'not run'}")
    m, s = divmod(total, 60)
    out.append(f"{'total':<{w}}  {total:>7}  ({m} min {s} s in these steps)")
    failed = [(r["step"], f) for r in rows for f in r.get("failures", [])]
    if failed:
        out.append("")
        out.append("what failed (the step's log above has the whole report):")
        out.extend(f"  {step}: {f}" for step, f in failed)
    print("\n".join(out), file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("go", help="filter go test -json (stdin) to go test's plain output, recording skips")
    c = sub.add_parser("check", help="check a step's report against tests/declared.toml")
    c.add_argument("--step", required=True)
    c.add_argument("--report", required=True)
    c.add_argument("--rc", type=int, required=True)
    c.add_argument("--seconds", type=int, required=True)
    c.add_argument("--load", required=True)
    c.add_argument("--summary", required=True)
    c.add_argument("--instances", default="", help="stallwatch.py's file of vLLM instance counts")
    c.add_argument("--t0", type=float, default=0.0, help="the step's start (unix time)")
    t = sub.add_parser("table", help="the summary table of a run")
    t.add_argument("--summary", required=True)
    t.add_argument("pending", nargs="*")
    sub.add_parser("validate", help="parse tests/declared.toml")
    a = ap.parse_args()
    if a.cmd == "go":
        go_filter(sys.stdin, sys.stdout)
    elif a.cmd == "check":
        alive = most_alive(a.instances, a.t0, time.time())
        sys.exit(check(a.step, a.report, a.rc, a.seconds, a.load, a.summary, alive))
    elif a.cmd == "table":
        table(a.summary, a.pending)
    elif a.cmd == "validate":
        d = load_declared()
        print(f"{os.path.relpath(DECLARED, ROOT)}: {len(d.get('skip', []))} declared skips, {len(d.get('retries', []))} retry allowances")


if __name__ == "__main__":
    main()
