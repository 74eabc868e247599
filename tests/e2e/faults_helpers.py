"""Helpers for the end-to-end fault test (test_faults.py).

Requests that never raise (an Outcome says how each one ended and how long
it took), the baseline's answers, classification against them, process-group
faults (SIGSTOP / SIGCONT / SIGKILL of a whole vLLM process group), restarting
a server and tracking its group, Prometheus gauges, decode-log failure kinds,
and the outcome tallies that the summary prints. Pure standard library; the
servers are started by run_faults_test.sh.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Optional

import e2e_common
from e2e_common import model_task

ENV = os.environ.get


@dataclasses.dataclass
class Outcome:
    """How one HTTP request ended. status: the HTTP status, 0 when no
    response came (connection refused or reset), -1 on a client timeout."""

    status: int
    elapsed: float
    started: float  # time.monotonic() at send
    ended: float
    body: Any = None  # parsed JSON when there was one
    error: str = ""

    @property
    def text(self) -> Optional[str]:
        try:
            return self.body["choices"][0]["text"]
        except (TypeError, KeyError, IndexError):
            return None

    @property
    def finish_reason(self) -> Optional[str]:
        try:
            return self.body["choices"][0]["finish_reason"]
        except (TypeError, KeyError, IndexError):
            return None

    @property
    def kv_transfer_params(self) -> Optional[dict]:
        try:
            return self.body.get("kv_transfer_params")
        except AttributeError:
            return None

    def brief(self) -> str:
        if self.status == 200:
            return f"200 {self.text!r} ({self.elapsed:.2f}s)"
        msg = self.error
        if isinstance(self.body, dict):
            err = self.body.get("error", self.body)
            msg = json.dumps(err)[:160]
        return f"{self.status} {msg[:160]} ({self.elapsed:.2f}s)"


def request(url: str, body: dict, timeout: float, path: str = "/v1/completions", request_id: str = "") -> Outcome:
    data = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id  # vLLM's request id is made from it
    req = urllib.request.Request(url + path, data=data, headers=headers)
    t0 = time.monotonic()

    def done(status: int, payload: Any = None, error: str = "") -> Outcome:
        t1 = time.monotonic()
        return Outcome(status, t1 - t0, t0, t1, payload, error)

    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            try:
                return done(r.status, json.loads(raw))
            except ValueError:
                return done(r.status, None, "non-JSON body: " + raw[:200].decode(errors="replace"))
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = None
        return done(e.code, payload, raw[:300].decode(errors="replace"))
    except (socket.timeout, TimeoutError) as e:
        return done(-1, None, f"client timeout after {timeout}s: {e}")
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            return done(-1, None, f"client timeout after {timeout}s: {e.reason}")
        return done(0, None, f"{type(e.reason).__name__}: {e.reason}")
    except (ConnectionError, OSError) as e:
        return done(0, None, f"{type(e).__name__}: {e}")


def completion_body(model: str, prompt: str, **extra: Any) -> dict:
    """The body test_accuracy.py sends (greedy, room for the longest key)."""
    body = {"model": model, "prompt": prompt, "max_tokens": model_task.MAX_KEY_LEN + 2, "temperature": 0, "seed": 0}
    body.update(extra)
    return body


def prefill_body(model: str, prompt: str) -> dict:
    """What the toy proxy sends a prefill instance (proxy/body.go)."""
    return completion_body(
        model,
        prompt,
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )


class Baseline:
    """The aggregated instance's answer per prompt, memoised."""

    def __init__(self, url: str, model: str, timeout: float = 120):
        self.url, self.model, self.timeout = url, model, timeout
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, prompt: str) -> str:
        with self._lock:
            if prompt in self._cache:
                return self._cache[prompt]
        o = request(self.url, completion_body(self.model, prompt), self.timeout)
        assert o.status == 200 and o.text is not None, f"baseline failed: {o.brief()}"
        with self._lock:
            self._cache[prompt] = o.text
        return o.text

    def warm(self, prompts: list[str]) -> None:
        for p in prompts:
            self(p)


def classify(o: Outcome, want: str) -> str:
    """correct (200, equal to the baseline), error (no 200, or vLLM's
    finish_reason "error"), or wrong (200 and different: never allowed)."""
    if o.status != 200 or o.text is None or o.finish_reason == "error":
        return "error"
    return "correct" if o.text == want else "wrong"


class Tally:
    """Outcome counts and measured times of one case (or sub-case)."""

    def __init__(self, name: str):
        self.name = name
        self.counts: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[str] = collections.Counter()
        self.measured: dict[str, str] = {}
        self.notes: list[str] = []
        self.wrong: list[str] = []

    def add(self, o: Outcome, want: str, label: str = "") -> str:
        kind = classify(o, want)
        self.counts[kind] += 1
        self.statuses[str(o.status)] += 1
        if kind == "wrong":
            self.wrong.append(f"{label}: got {o.text!r}, baseline {want!r}")
        return kind

    def measure(self, key: str, value: float, bound: Optional[float] = None, unit: str = "s") -> None:
        self.measured[key] = f"{value:.2f}{unit}" + (f" (bound {bound:g}{unit})" if bound is not None else "")

    def line(self) -> str:
        c = self.counts
        parts = [f"correct {c['correct']}", f"error {c['error']}", f"wrong {c['wrong']}"]
        s = f"{self.name}: " + ", ".join(parts)
        if self.statuses:
            s += " | HTTP " + " ".join(f"{k}x{v}" for k, v in sorted(self.statuses.items()))
        if self.measured:
            s += " | " + ", ".join(f"{k} {v}" for k, v in self.measured.items())
        for n in self.notes:
            s += f"\n    {n}"
        return s


class Summary:
    """Every case's tallies, written to $GONIXL_FAULTS_SUMMARY as they close."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self.tallies: list[Tally] = []

    def tally(self, name: str) -> Tally:
        t = Tally(name)
        self.tallies.append(t)
        return t

    def write(self) -> str:
        text = "fault test summary (correct = equal to the baseline; error = HTTP error or finish_reason error; wrong = HTTP 200 differing from the baseline)\n"
        text += "\n".join("  " + t.line() for t in self.tallies) + "\n"
        if self.path:
            with open(self.path, "w") as f:
                f.write(text)
        return text


# ----------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------


class Groups:
    """Signals to whole process groups, remembering which are paused so that
    every exit path resumes them."""

    def __init__(self, extra_pgids_file: Optional[str]):
        self.paused: set[int] = set()
        self.started: list[subprocess.Popen] = []
        self.extra_file = extra_pgids_file
        self._lock = threading.Lock()

    def stop(self, pgid: int) -> None:
        with self._lock:
            self.paused.add(pgid)
        os.killpg(pgid, signal.SIGSTOP)

    def cont(self, pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        with self._lock:
            self.paused.discard(pgid)

    def kill(self, pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with self._lock:
            self.paused.discard(pgid)

    @staticmethod
    def alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def wait_gone(self, pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Reap our own children, or they linger as zombies in the group.
            for p in self.started:
                p.poll()
            if not self.alive(pgid):
                return True
            time.sleep(0.05)
        return not self.alive(pgid)

    @staticmethod
    def members(pgid: int) -> list[int]:
        """The pids of a process group (from /proc)."""
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    st = f.read()
            except OSError:
                continue
            fields = st[st.rindex(b")") + 2 :].split()
            if int(fields[2]) == pgid:  # state, ppid, pgrp
                out.append(int(d))
        return out

    @staticmethod
    def dead(pids: list[int]) -> bool:
        """Every pid gone or a zombie (its memory and sockets released)."""
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    st = f.read()
            except OSError:
                continue
            if st[st.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X"):
                return False
        return True

    def start(self, argv: list[str], log_path: str) -> subprocess.Popen:
        """argv in a new session (its own process group), output to log_path;
        the group is recorded for run_faults_test.sh's exit trap at once."""
        log = open(log_path, "wb")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.started.append(p)
        if self.extra_file:
            with open(self.extra_file, "a") as f:
                f.write(f"{p.pid}\n")
        return p

    def cleanup(self) -> None:
        """Resume every paused group; stop every group this test started."""
        for pg in list(self.paused):
            self.cont(pg)
        for p in self.started:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in self.started:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ----------------------------------------------------------------------------
# Servers, metrics, logs
# ----------------------------------------------------------------------------


def health(url: str, timeout: float = 10) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return 0


def wait_until(pred: Callable[[], Any], timeout: float, interval: float = 0.1) -> tuple[Any, float]:
    """Polls pred until it returns a true value or timeout passes: (value, seconds waited)."""
    t0 = time.monotonic()
    while True:
        v = pred()
        if v or time.monotonic() - t0 >= timeout:
            return v, time.monotonic() - t0
        time.sleep(interval)


def metrics(url: str) -> str:
    return e2e_common.metrics(url)


def gauge(text: str, name: str) -> Optional[float]:
    """The (summed) value of a gauge, None when the instance does not export it."""
    found = False
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = True
            total += float(line.rsplit(" ", 1)[1])
    return total if found else None


def group_states(pgid: int) -> dict[int, str]:
    """{pid: state letter} of every process in process group pgid, from
    /proc/<pid>/stat ('T': stopped by a signal). A fault case that needs a
    frozen peer says with it whether the peer really was."""
    states: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces or ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[2] == str(pgid):
            states[int(name)] = fields[0]
    return states


def log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


FAILURE_RE = re.compile(r"NIXL transfer failure: (\w+)(?:\. ([^|]*))?")


def failure_kinds(log_text: str) -> collections.Counter[str]:
    """gonixl's "NIXL transfer failure: <kind>" lines, by kind."""
    return collections.Counter(m.group(1) for m in FAILURE_RE.finditer(log_text))


def failure_messages(log_text: str, kind: str) -> list[str]:
    return [(m.group(2) or "").strip() for m in FAILURE_RE.finditer(log_text) if m.group(1) == kind]


_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")


def _ts(line: str) -> Optional[float]:
    m = _TS.match(line)
    if not m:
        return None
    import datetime

    return datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp()


def read_duration(log_text: str) -> Optional[float]:
    """Seconds from a READ's post to its transfer_timeout failure, from
    gonixl's log: the "READ still in flight" warning says how long the READ
    had been in flight at its own timestamp; the failure line has its time."""
    posted = failed = None
    for line in log_text.splitlines():
        if posted is None and "READ still in flight" in line:
            m = re.search(r'"seconds": ([0-9.]+)', line)
            t = _ts(line)
            if m and t is not None:
                posted = t - float(m.group(1))
        elif posted is not None and "NIXL transfer failure: transfer_failed" in line and "transfer_timeout" in line:
            failed = _ts(line)
            break
    if posted is None or failed is None:
        return None
    return failed - posted


def handshake_duration(log_text: str, hostport: str) -> Optional[float]:
    """Seconds from the first gonixl log line naming hostport (the request
    that sent the decode there) to its "handshake_failed ... at hostport"
    line; None without both."""
    first = failed = None
    for line in log_text.splitlines():
        if hostport not in line:
            continue
        t = _ts(line)
        if t is None:
            continue
        if first is None:
            first = t
        if "NIXL transfer failure: handshake_failed. engine" in line and f" at {hostport} " in line:
            failed = t
            break
    if first is None or failed is None:
        return None
    return failed - first


def examples(seed: int, lengths: list[int]) -> list[model_task.Example]:
    return model_task.examples(seed, lengths)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
