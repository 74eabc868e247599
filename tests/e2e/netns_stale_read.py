"""One side of netns_stale_read.sh: a READ stranded by a cut link, after it
has been reported failed, must not write into the decode's KV cache when the
link comes back.

    netns_stale_read.py prefill|decode DIR IP

Each side is one vLLM instance of tests/python/connector_harness.py (real
GoNixlConnector scheduler + worker, real vLLM config objects and CPU KV
tensors, transfer_engine $GONIXL_STALE_ENGINE, default ucx; no UCX_* variable), in its own network
namespace, its side channel on IP. The sides and the controller
(netns_stale_read.sh) meet through files in DIR:

  prefill: prefills "warm" (2 blocks) and "r1" (8 blocks), writes params.json,
           then keeps stepping (serving READs) until DIR/stop.
  decode:  reads "warm" (the UCX endpoint and its TCP connection now exist),
           writes warm_done; after DIR/cut (the prefill's link is down)
           schedules "r1": its READ cannot progress; once gonixl reports r1
           failed (transfer_timeout) the decode does what vLLM does with the
           blocks next (kv_load_failure_policy recompute writes them again;
           fail frees them for other requests): it fills them with a
           sentinel, writes failed, and after DIR/restored (link up) watches
           them for WATCH_S seconds.

Exit status of the decode: 0 the blocks kept the sentinel; 3 a block was
overwritten after its READ had been reported failed (the stale READ
completed into memory vLLM had taken back); 1 anything else.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

ROLE, DIR, IP = sys.argv[1], sys.argv[2], sys.argv[3]
TRANSFER_TIMEOUT_S = 5.0
ENGINE = os.environ.get("GONIXL_STALE_ENGINE", "ucx")  # transfer_engine of both sides
WATCH_S = float(os.environ.get("GONIXL_STALE_WATCH_S", "90"))
SENTINEL = 42.0


class _Environ:
    """connector_harness pins the side channel to 127.0.0.1; here it must be
    this namespace's address, reachable from the other namespace."""

    def __setitem__(self, k, v):
        os.environ[k] = IP if k == "VLLM_NIXL_SIDE_CHANNEL_HOST" else v

    def __getitem__(self, k):
        return os.environ[k]

    def get(self, k, d=None):
        return os.environ.get(k, d)

    def pop(self, k, *d):
        if k == "VLLM_NIXL_SIDE_CHANNEL_HOST":
            return os.environ.get(k)  # keep it for the connector's later reads
        return os.environ.pop(k, *d)


import connector_harness as h  # noqa: E402  (imports vLLM)

h.os = types.SimpleNamespace(environ=_Environ(), path=os.path)


def log(msg: str) -> None:
    print(f"[{ROLE} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_file(name: str, timeout: float, engines=()) -> None:
    deadline = time.monotonic() + timeout
    path = os.path.join(DIR, name)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{ROLE}: {name} did not appear within {timeout:.0f} s")
        for e in engines:
            e.step()
        time.sleep(0.01)


def touch(name: str) -> None:
    with open(os.path.join(DIR, name), "w") as f:
        f.write(str(time.time()))


def dist_env() -> None:
    from vllm.distributed import parallel_state as ps

    vc = h.make_vllm_config("kv_both", "dist-init", {})
    with h.set_current_vllm_config(vc):
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{h.free_port()}",
                                        local_rank=0, backend="gloo")
        ps.ensure_model_parallel_initialized(1, 1)


def main() -> int:
    from gonixl.vllm import GoNixlConnector

    dist_env()
    if ROLE == "prefill":
        p = h.Engine(GoNixlConnector, "kv_producer", "stale-p", 40, extra={"transfer_engine": ENGINE, "kv_lease_duration": 600})
        warm = h.prefill(p, "warm", 64, 1.0)
        r1 = h.prefill(p, "r1", 256, 7.0)
        with open(os.path.join(DIR, "params.json.tmp"), "w") as f:
            json.dump({"warm": warm.params, "r1": r1.params}, f)
        os.rename(os.path.join(DIR, "params.json.tmp"), os.path.join(DIR, "params.json"))
        log(f"prefilled warm {warm.block_ids} and r1 {r1.block_ids}; serving until stop")
        wait_file("stop", 600, [p])
        p.shutdown()
        return 0

    d = h.Engine(GoNixlConnector, "kv_consumer", "stale-d", 56,
                 extra={"transfer_engine": ENGINE, "transfer_timeout": TRANSFER_TIMEOUT_S})
    d.fill_all(0.0)
    wait_file("params.json", 300, [d])
    with open(os.path.join(DIR, "params.json")) as f:
        params = json.load(f)
    log(f"prefill's side channel: {params['r1']['remote_host']}:{params['r1']['remote_port']}")
    w = h.schedule_decode(d, "warm", 64, params["warm"])
    h.run_until([d], lambda: "warm" in d.out.recving, "warm READ", timeout=60)
    layer = h.layer_names(d.vllm_config)[0]
    assert "warm" not in d.out.failed and all(float(d.block(layer, b).abs().sum()) > 0 for b in w.new_blocks), "warm READ moved no data"
    log(f"warm READ done into blocks {w.new_blocks}")
    touch("warm_done")
    wait_file("cut", 60, [d])

    r = h.schedule_decode(d, "r1", 256, params["r1"])
    t0 = time.monotonic()
    h.run_until([d], lambda: "r1" in d.out.recving, "r1 reported", timeout=TRANSFER_TIMEOUT_S + 60)
    invalid = d.out.invalid_until_recv("r1")
    log(f"r1 reported after {time.monotonic() - t0:.1f} s: failed={'r1' in d.out.failed}, invalid blocks {sorted(invalid)}, its blocks {r.new_blocks}")
    if not set(r.new_blocks) <= invalid:
        log("r1's READ did not fail: the cut did not strand it")
        touch("failed")
        d.shutdown()
        log("shut down")
        touch("stop")
        return 1
    # What vLLM does with the blocks next: recompute them (policy
    # recompute) or give them to another request (policy fail).
    for b in r.new_blocks:
        for t in d.kv_caches.values():
            t[b].fill_(SENTINEL)
    touch("failed")
    wait_file("restored", 60, [d])
    t_up = time.monotonic()
    log(f"link back up; watching blocks {r.new_blocks} for {WATCH_S:.0f} s")
    rc = 0
    while time.monotonic() - t_up < WATCH_S:
        d.step()
        changed = [b for b in r.new_blocks if any(not bool((t[b] == SENTINEL).all()) for t in d.kv_caches.values())]
        if changed:
            b = changed[0]
            first = float(d.block(layer, b).flatten()[0])
            log(f"STALE WRITE: {len(changed)} of r1's {len(r.new_blocks)} blocks ({changed}) overwritten "
                f"{time.monotonic() - t_up:.1f} s after the link came back, {time.monotonic() - t0:.1f} s after the READ was posted "
                f"and after gonixl had reported it failed; block {b} now starts with {first} (the prefill wrote 7000 + layer*100 + its block id)")
            rc = 3
            break
        time.sleep(0.05)
    else:
        log(f"no block of r1 changed in {WATCH_S:.0f} s after the link came back")
    d.shutdown()
    log("shut down")
    touch("stop")
    return rc


if __name__ == "__main__":
    sys.exit(main())
