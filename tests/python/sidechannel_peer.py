"""A Python side-channel peer written to vLLM's NIXL handshake protocol.

Used by test_sidechannel.py when it needs a peer that is not vLLM's own code
(vLLM's listener/handshake functions are used too when vLLM is importable).
Protocol: REQ -> msgpack((b"get_meta_msg", pp, tp)); ROUTER replies
[identity, b"", payload, msgpack(float clock)].
"""

import threading
import time

import msgspec
import zmq

GET_META_MSG = b"get_meta_msg"


def query(host: str, port: int, ranks, timeout_ms: int = 5000):
    """Query each (pp, tp) rank; return [(payload_bytes, clock_frame, rtt)]."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        out = []
        for pp, tp in ranks:
            t0 = time.perf_counter()
            sock.send(msgspec.msgpack.encode((GET_META_MSG, pp, tp)))
            parts = sock.recv_multipart()
            out.append((parts, time.perf_counter() - t0))
        return out
    finally:
        ctx.destroy(linger=0)


def send_raw(host: str, port: int, frames, timeout_ms: int = 5000):
    """Send one raw multipart request on a fresh REQ socket; return the reply."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart(frames)
        return sock.recv_multipart()
    finally:
        ctx.destroy(linger=0)


class Listener:
    """A ROUTER listener serving encoded payloads per (pp, tp), like vLLM's,
    but that survives bad requests (it skips them)."""

    def __init__(self, host: str, port: int, encoded: dict):
        self.encoded = encoded
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.bind(f"tcp://{host}:{port}")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                identity, _, msg = self.sock.recv_multipart()
            except zmq.Again:
                continue
            except ValueError:
                continue
            try:
                _, pp, tp = msgspec.msgpack.decode(msg)
                payload = self.encoded[(pp, tp)]
            except Exception:
                continue
            ts = msgspec.msgpack.encode(time.perf_counter())
            self.sock.send_multipart((identity, b"", payload, ts))

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.ctx.destroy(linger=0)
