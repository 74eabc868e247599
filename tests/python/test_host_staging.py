"""Host staging (vLLM's use_host_buffer), a prefill's saves: every block a
step writes is copied into the host mirror after the step's forward — the
new blocks and the block the last chunk ended in, which a chunked prompt's
next chunk completes without allocating it. A block left out keeps its tail
from before the chunk in the mirror, and the decode would read that."""

from types import SimpleNamespace
from typing import Any

from gonixl.vllm import GoNixlConnector


def _connector(req_id: str, prompt: int) -> tuple[GoNixlConnector, Any]:
    c = GoNixlConnector.__new__(GoNixlConnector)  # the staging save state only
    req = SimpleNamespace(request_id=req_id, num_computed_tokens=0, num_prompt_tokens=prompt)
    c._need_save = {req_id: req}
    c._save_tails = {}
    return c, req


def _step(
    c: GoNixlConnector, req: Any, scheduled: int, new: Any = None, cached: Any = None, resumed: bool = False
) -> dict[str, list[int]]:
    """One engine step of req: new (block id groups of a new request, or of
    one resumed by vLLM's V2 model runner) or cached (its new block id
    groups, None when it got none)."""
    out = SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=new)] if new is not None else [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[req.request_id] if new is None else [],
            new_block_ids=[cached] if new is None else [],
            resumed_req_ids={req.request_id} if resumed else set(),
        ),
        num_scheduled_tokens={req.request_id: scheduled},
    )
    save = c._staging_saves(out)
    req.num_computed_tokens += scheduled  # vLLM advances it after build_connector_meta
    return save


def test_a_chunk_that_completes_the_last_block_saves_it_again() -> None:
    # Block size 16, a 40-token prompt in chunks of 20, 10, 10: the first
    # ends inside block 6, the second fits in it (no new block), the third
    # completes it and starts block 7.
    c, req = _connector("r", 40)
    assert _step(c, req, 20, new=([5, 6],)) == {"r": [5, 6]}
    assert _step(c, req, 10, cached=None) == {"r": [6]}, "the block the chunk wrote was not saved"
    assert _step(c, req, 10, cached=([7],)) == {"r": [6, 7]}
    assert not c._need_save and not c._save_tails, "state kept after the prompt was done"
    assert _step(c, req, 1, cached=None) == {}, "a decode step of a done prompt saved blocks"


def test_two_groups_each_save_their_last_block() -> None:
    c, req = _connector("r", 40)
    assert _step(c, req, 20, new=([5, 6], [9, 10])) == {"r": [5, 6, 9, 10]}
    assert _step(c, req, 16, cached=([7], [])) == {"r": [6, 10, 7]}
    assert c._save_tails["r"] == [7, 10]


def test_a_resumed_request_saves_its_new_blocks_only() -> None:
    # Preempted and resumed: vLLM hands it every block anew (the old tail
    # may belong to another request by now).
    c, req = _connector("r", 64)
    _step(c, req, 20, new=([5, 6],))
    req.num_computed_tokens = 0
    assert _step(c, req, 30, cached=([11, 12],), resumed=True) == {"r": [11, 12]}
    assert c._save_tails["r"] == [12]


def test_a_request_resumed_as_new_saves_its_new_blocks_only() -> None:
    # vLLM's V2 model runner lists a resumed request among the new ones
    # (resumed False): its tail from before the preemption is not saved
    # (freed with it, another request's KV by now).
    c, req = _connector("r", 64)
    _step(c, req, 20, new=([5, 6],))
    req.num_computed_tokens = 0
    assert _step(c, req, 30, new=([11, 12],)) == {"r": [11, 12]}
    assert c._save_tails["r"] == [12]


def test_a_preemption_forgets_the_tail() -> None:
    c, req = _connector("r", 64)
    _step(c, req, 20, new=([5, 6],))
    empty = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    out = SimpleNamespace(preempted_req_ids={"r"}, scheduled_new_reqs=[], scheduled_cached_reqs=empty, num_scheduled_tokens={})
    assert c._staging_saves(out) == {}
    assert "r" not in c._save_tails
