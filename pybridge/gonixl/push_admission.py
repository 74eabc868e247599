"""Push mode, a prefill's scheduler: how much KV may wait for a decode.

A push prefill computes a request's prompt and then holds its blocks until
the decode's registration arrives and the WRITE lands. A decode registers
only once its own scheduler has allocated blocks for the request. Under
KV-cache pressure the two can wait on each other: the prefill's cache full
of computed prompts whose decodes have no room yet, the decode's full of
requests the prefill has no room to compute (vLLM admits a request only
when its whole prompt fits). Nothing moves until a lease or a client's
deadline ends it.

The admission breaks that cycle on the prefill's side. A push request
whose decode has registered ("claimed") is always admitted: its blocks go
to the decode as soon as they are computed. A request not claimed yet is
admitted only while the prompts admitted unclaimed fit in a budget of
blocks (``push_unclaimed_blocks``; by default the KV cache less one
longest prompt and one block), and always when none is: one at a time
still moves a proxy that sends the decode's request only after the
prefill's answer. The rest wait in vLLM's queue, holding nothing
(get_num_new_matched_tokens answers "not yet"). So the prefill always has
room for a claimed request of any length, the decode's allocated requests
are always computed, and the decode's progress frees the prefill's holds.
A charge ends when the request's registration arrives, when its hold ends
(finished_sending) or when it finishes without one.

Registrations reach the prefill's workers (a NIXL notification to each
rank); each worker reports the base request ids (vLLM's
get_base_request_id: a client's id without the suffix vLLM adds, the
same on both sides) through vLLM's worker metadata (GoNixlWorkerMeta),
and update_connector_output hands them here. A registration that comes
before its request is kept for ``memory`` seconds.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable


class PushAdmission:
    """The admission state of one prefill scheduler (not thread-safe: vLLM
    calls its scheduler from one thread)."""

    def __init__(self, budget_blocks: int, block_size: int, memory: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.budget = max(0, int(budget_blocks))
        self._block_size = block_size
        self._memory = memory
        self._clock = clock
        self._claimed: dict[str, float] = {}  # base id -> when its registration arrived
        self._charged: dict[str, tuple[str, int]] = {}  # request id -> (base id, blocks)
        self.charged_blocks = 0
        self.deferred: set[str] = set()  # requests told "not yet" and not admitted since

    def _blocks(self, num_prompt_tokens: int) -> int:
        return max(1, -(-num_prompt_tokens // self._block_size))

    def claimed(self, base_ids: Iterable[str]) -> None:
        """Registrations for these base ids arrived."""
        now = self._clock()
        got = set(base_ids)
        for b in got:
            self._claimed[b] = now
        if self._charged:
            for rid in [r for r, (b, _) in self._charged.items() if b in got]:
                self._release(rid)
        self._expire(now)

    def admit(self, request_id: str, base_id: str, num_prompt_tokens: int) -> bool:
        """Whether the request may be scheduled now. A True answer for an
        unclaimed request must be followed by allocated() when vLLM
        allocates it (in the same scheduling pass)."""
        if request_id in self._charged or base_id in self._claimed:
            self.deferred.discard(request_id)
            return True
        if self.charged_blocks == 0 or self.charged_blocks + self._blocks(num_prompt_tokens) <= self.budget:
            self.deferred.discard(request_id)
            return True
        self.deferred.add(request_id)
        return False

    def allocated(self, request_id: str, base_id: str, num_prompt_tokens: int) -> None:
        """vLLM allocated the request's blocks: charged unless claimed."""
        if request_id in self._charged or base_id in self._claimed:
            return
        n = self._blocks(num_prompt_tokens)
        self._charged[request_id] = (base_id, n)
        self.charged_blocks += n

    def finished(self, request_id: str, base_id: str, held: bool) -> None:
        """request_finished: a request that holds no blocks (held False)
        ends its charge; a claim is no longer needed either way."""
        self.deferred.discard(request_id)
        if not held:
            self._release(request_id)
        self._claimed.pop(base_id, None)

    def hold_ended(self, request_ids: Iterable[str]) -> None:
        """finished_sending: these requests' blocks are free."""
        for rid in request_ids:
            self._release(rid)

    def _release(self, request_id: str) -> None:
        got = self._charged.pop(request_id, None)
        if got is not None:
            self.charged_blocks -= got[1]

    def _expire(self, now: float) -> None:
        if len(self._claimed) < 64:
            return
        horizon = now - self._memory
        for b in [b for b, t in self._claimed.items() if t < horizon]:
            del self._claimed[b]


def default_budget(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """The KV cache less one longest prompt and one block: a claimed
    request of any length still fits beside the unclaimed ones."""
    return max(0, num_blocks - (-(-max_model_len // block_size)) - 1)
