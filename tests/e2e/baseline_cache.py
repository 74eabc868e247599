"""One aggregated baseline of a model for several steps of ./build.sh test.

    python tests/e2e/baseline_cache.py MODEL URL_FILE

Starts the model's aggregated vLLM (tests/e2e/run_baseline.sh: no
connector, lib.sh's flags) and serves, on a free loopback port written to
URL_FILE, the same OpenAI endpoints in front of it, remembering every
non-streamed answer by its request (method, path and body; the body as
JSON with sorted keys). A request asked before is answered from memory, the
same bytes the server gave the first time: the steps of a model share one
baseline start-up, and the prompt sets they share (test_interop.py's and
run_tp_test.sh's are the first N of one list) are computed once.

POST /_baseline/cache_only stops the vLLM: from then on only remembered
answers are given, and any other request gets HTTP 503 saying so (the test
that sent it fails; it never gets another server's answer). ./build.sh test
sends it once the steps that ask new prompts are done, so that the steps
after them can run three vLLM instances of their own. GET /health is the
vLLM's until then, 200 after. SIGTERM stops the vLLM and this server.
Standard library only.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


class State:
    def __init__(self, model: str, logs: str) -> None:
        self.model = model
        self.lock = threading.Lock()
        self.cache: dict[str, tuple[int, str, bytes]] = {}
        self.hits = self.misses = self.refused = 0
        self.cache_only = False
        self.upstream = ""
        url_file = os.path.join(logs, "upstream.url")
        if os.path.exists(url_file):
            os.remove(url_file)
        # run_baseline.sh in a session of its own: stopping it (SIGTERM) runs
        # its exit trap, which stops the vLLM's process group.
        with open(os.path.join(logs, "run_baseline.out"), "w") as out:
            self.proc = subprocess.Popen(
                ["bash", os.path.join(HERE, "run_baseline.sh"), model, url_file],
                start_new_session=True,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 120
        while not os.path.exists(url_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"baseline_cache: run_baseline.sh gave no URL (exit {self.proc.poll()}); see {logs}")
            time.sleep(0.1)
        with open(url_file) as f:
            self.upstream = f.read().strip()

    def stop_upstream(self) -> None:
        with self.lock:
            self.cache_only = True
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def stats(self) -> str:
        return f"{len(self.cache)} answers remembered, {self.hits} hits, {self.misses} misses, {self.refused} refused (cache only)"


STATE: State


def say(msg: str) -> None:
    print(f"baseline_cache [{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args) -> None:  # quiet: a line per miss instead
        pass

    def reply(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def error(self, status: int, msg: str) -> None:
        self.reply(status, "application/json", json.dumps({"error": {"message": f"baseline cache: {msg}", "code": status}}).encode())

    def forward(self, body: bytes | None) -> tuple[int, str, bytes]:
        req = urllib.request.Request(STATE.upstream + self.path, data=body, method=self.command)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                return r.status, r.headers.get("Content-Type", "application/json"), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", "application/json"), e.read()

    def do_GET(self) -> None:
        if self.path == "/_baseline/stats":
            self.reply(200, "text/plain", (STATE.stats() + "\n").encode())
            return
        if STATE.cache_only:
            if self.path == "/health":
                self.reply(200, "text/plain", b"")
            else:
                self.error(503, f"GET {self.path}: the baseline server was stopped (cache only)")
            return
        try:
            self.reply(*self.forward(None))
        except (urllib.error.URLError, OSError) as e:
            self.error(503, f"the baseline server does not answer: {e}")

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        if self.path == "/_baseline/cache_only":
            STATE.stop_upstream()
            say(f"cache only from now on: {STATE.stats()}")
            self.reply(200, "text/plain", (STATE.stats() + "\n").encode())
            return
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self.error(400, "the request body is not JSON")
            return
        stream = bool(body.get("stream")) if isinstance(body, dict) else False
        key = hashlib.sha256(json.dumps([self.command, self.path, body], sort_keys=True).encode()).hexdigest()
        with STATE.lock:
            hit = STATE.cache.get(key)
            if hit is not None:
                STATE.hits += 1
            cache_only = STATE.cache_only
        if hit is not None:
            self.reply(*hit)
            return
        if cache_only:
            with STATE.lock:
                STATE.refused += 1
            prompt = body.get("prompt") if isinstance(body, dict) else None
            say(f"refused (cache only): POST {self.path} prompt length {len(prompt) if isinstance(prompt, str) else '?'}")
            self.error(
                503,
                f"POST {self.path}: no remembered answer for this request, and the baseline server was stopped "
                "(./build.sh test stops it once the steps that ask new prompts are done; a later step asked one)",
            )
            return
        try:
            status, ctype, out = self.forward(raw)
        except (urllib.error.URLError, OSError) as e:
            self.error(503, f"the baseline server does not answer: {e}")
            return
        if status == 200 and not stream:
            with STATE.lock:
                STATE.cache[key] = (status, ctype, out)
                STATE.misses += 1
        self.reply(status, ctype, out)


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


def main() -> None:
    global STATE
    if len(sys.argv) != 3:
        raise SystemExit("usage: baseline_cache.py MODEL URL_FILE")
    model, url_file = sys.argv[1], sys.argv[2]
    logs = os.environ.get("GONIXL_E2E_LOGS") or os.path.join(HERE, "logs", f"baseline-{os.path.basename(model)}")
    os.makedirs(logs, exist_ok=True)
    os.environ["GONIXL_E2E_LOGS"] = logs
    STATE = State(model, logs)
    srv = Server(("127.0.0.1", 0), Handler)
    port = srv.server_address[1]

    def stop(*_) -> None:
        say(f"stopping: {STATE.stats()}")
        STATE.stop_upstream()
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with open(url_file + ".tmp", "w") as f:
        f.write(f"http://127.0.0.1:{port}\n")
    os.replace(url_file + ".tmp", url_file)
    say(f"{model}: serving on 127.0.0.1:{port} in front of {STATE.upstream}")
    try:
        srv.serve_forever(poll_interval=0.2)
    finally:
        STATE.stop_upstream()
        say(f"stopped: {STATE.stats()}")


if __name__ == "__main__":
    socket.setdefaulttimeout(None)
    main()
