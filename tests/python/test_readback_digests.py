"""A bidirectional decode's read-back digests on the scheduler side: each tp
rank hashes its holds on a goroutine of its own (shim/kvdigest_readback.go),
so their digests can reach update_connector_output in different steps; the
hold is served once every rank's came, as none when a rank could not hash
it, and never from a partial set."""

import random
from typing import Any

from gonixl.vllm import GoNixlConnector, GoNixlWorkerMeta, _digest_places, _pack_u64, _placed, _search_places


class _Sched:
    def __init__(self) -> None:
        self.served: list[dict[str, Any]] = []

    def kv_digests(self, served: dict[str, Any]) -> None:
        self.served.append(dict(served))


def _connector(tp: int) -> tuple[GoNixlConnector, _Sched]:
    c = GoNixlConnector.__new__(GoNixlConnector)  # the scheduler side's digest state only
    sched = _Sched()
    c._scheduler = lambda: sched  # type: ignore[method-assign]
    c._warned_digest = False
    c._digest_sent = {"r": (64, [[7, 8]])}
    c._readback_asked = {"r": ({"remote_block_ids": [[7, 8]], "tp_size": tp}, 1e18)}
    c._readback_got = {}
    return c, sched


def _rank(seed: int) -> dict[str, Any]:
    return {"blocks": [[seed, seed + 1]], "regions": [[seed * 10]]}


def test_ranks_digests_from_different_steps_are_served_together() -> None:
    c, sched = _connector(tp=2)
    c._serve_digests(GoNixlWorkerMeta(frozenset(), {"r": {1: _rank(20)}}))
    assert sched.served == [], "served before every rank's digests came"
    c._serve_digests(GoNixlWorkerMeta(frozenset(), {"r": {0: _rank(10)}}))
    assert len(sched.served) == 1, sched.served
    kd = sched.served[0]["r"]
    assert [r["blocks"][0] for r in kd["ranks"]] == [_pack_u64([10, 11]), _pack_u64([20, 21])]
    assert not c._readback_asked and not c._readback_got and not c._digest_sent


def test_a_rank_that_could_not_hash_serves_none() -> None:
    c, sched = _connector(tp=2)
    c._serve_digests(GoNixlWorkerMeta(frozenset(), {"r": {0: _rank(10), 1: None}}))
    assert sched.served == [{"r": None}]
    assert not c._readback_asked and not c._readback_got and not c._digest_sent


def test_one_rank_serves_at_once() -> None:
    c, sched = _connector(tp=1)
    c._serve_digests(GoNixlWorkerMeta(frozenset(), {"r": {0: _rank(10)}}))
    assert len(sched.served) == 1 and sched.served[0]["r"] is not None


def test_digest_places_shortcut_places_as_the_search_does() -> None:
    # The params name the prompt's digested blocks as they are (the usual
    # case) and skip the search; every other shape searches. Either way
    # each block gets the digest of its own place.
    rng = random.Random(7)
    shortcuts = 0
    for _ in range(3000):
        n = rng.randrange(0, 12)
        digested = rng.sample(range(100), n)
        for j in range(n):
            if rng.random() < 0.1:
                digested[j] = -1
            elif rng.random() < 0.05 and j:
                digested[j] = digested[j - 1]
        form = rng.randrange(5)
        if form == 0:
            ids = list(digested)
        elif form == 1 and n:
            lo = rng.randrange(n)
            ids = digested[lo : rng.randrange(lo, n + 1)]
        elif form == 2:
            ids = rng.sample(range(100), rng.randrange(0, 12))
        elif form == 3:
            ids = list(reversed(digested))
        else:
            ids = [b if b >= 0 else rng.randrange(100) for b in digested] + [rng.randrange(100)] * rng.randrange(2)
        want = _search_places(ids, digested)
        got = _digest_places(tuple(ids), digested)
        if want is None:
            assert got is None, (ids, digested)
            continue
        assert got is not None and got[0] == want[0] and got[2] == want[2], (ids, digested, got, want)
        shortcuts += got[1] is None
        digests = [rng.getrandbits(64) for _ in digested]
        assert list(_placed(digests, got[1], len(ids))) == [0 if j is None else digests[j] for j in want[1]], (ids, digested)
    assert shortcuts > 300  # the usual case takes the shortcut
