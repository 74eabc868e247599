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
longest prompt and one block, counted over every KV-cache group, which
share one pool), and always when none is: one at a time still moves a
proxy that sends the decode's request only after the prefill's answer.
Unclaimed requests keep their order: once one is deferred in a scheduling
pass, the unclaimed ones after it are too (a long prompt is not passed for
ever by short ones). The rest wait in vLLM's queue, holding nothing
(get_num_new_matched_tokens answers "not yet"). So the prefill always has
room for a claimed request of any length, the decode's allocated requests
are always computed, and the decode's progress frees the prefill's holds.

A charge ends when a registration for the request arrives, when its hold
ends (finished_sending), when it finishes without one, or, as a safety
valve, ``hold_limit`` seconds after its hold began (the lease frees those
blocks by then; logged by the caller).

Registrations reach the prefill's workers (a NIXL notification to each
rank); each worker reports the base request ids (vLLM's
get_base_request_id: a client's id without the suffix vLLM adds, the same
on both sides) through vLLM's worker metadata (GoNixlWorkerMeta), and
update_connector_output hands them here. A claim is consumed by the
request it admits; one for a request not seen yet is kept while a request
of that base waits, else ``memory`` seconds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Iterable, Sequence


def prompt_blocks(num_tokens: int, block_sizes: Sequence[int]) -> int:
    """Blocks a prompt of num_tokens takes from the KV cache's one pool:
    a block per block_size tokens in every KV-cache group (a
    sliding-window group allocates its whole chunk during a prefill)."""
    return sum(max(1, -(-num_tokens // bs)) for bs in block_sizes)


def default_budget(num_blocks: int, longest_prompt_blocks: int) -> int:
    """The KV cache less one longest prompt and one block: a claimed
    request of any length still fits beside the unclaimed ones."""
    return max(0, num_blocks - longest_prompt_blocks - 1)


class PushAdmission:
    """The admission state of one prefill scheduler (not thread-safe: vLLM
    calls its scheduler from one thread)."""

    def __init__(
        self,
        budget_blocks: int,
        blocks_of: Callable[[int], int],
        memory: float = 60.0,
        hold_limit: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.budget = max(0, int(budget_blocks))
        self._blocks_of = blocks_of
        self._memory = memory
        self._hold_limit = hold_limit
        self._clock = clock
        self._claimed: OrderedDict[str, float] = OrderedDict()  # base id -> arrival, oldest first
        self._charged: dict[str, tuple[str, int]] = {}  # request id -> (base id, blocks)
        self._holds: OrderedDict[str, float] = OrderedDict()  # charged request id -> when its hold began
        self._asking: dict[str, int] = {}  # base id -> waiting requests asked about (not allocated)
        self._asked: dict[str, str] = {}  # request id -> base id, for _asking
        self.charged_blocks = 0
        self.deferred: set[str] = set()  # requests told "not yet" since their last admission
        self._blocked = False  # an unclaimed request was deferred in this scheduling pass
        self.expired: list[str] = []  # charges the safety valve ended, for the caller's log

    def new_pass(self) -> None:
        """A scheduling pass ended (build_connector_meta)."""
        self._blocked = False

    def claimed(self, base_ids: Iterable[str]) -> None:
        """Registrations for these base ids arrived: each ends the charge of
        one request of that base, or claims the next one to be admitted."""
        now = self._clock()
        for b in set(base_ids):
            rid = next((r for r, (cb, _) in self._charged.items() if cb == b), None)
            if rid is not None:
                self._release(rid)
                continue
            self._claimed[b] = now
            self._claimed.move_to_end(b)
        self._expire(now)

    def admit(self, request_id: str, base_id: str, num_prompt_tokens: int) -> bool:
        """Whether the request may be scheduled now. A True answer must be
        followed by allocated() when vLLM allocates it."""
        if request_id not in self._asked:
            self._asked[request_id] = base_id
            self._asking[base_id] = self._asking.get(base_id, 0) + 1
        if request_id in self._charged or base_id in self._claimed:
            self.deferred.discard(request_id)
            return True
        fits = self.charged_blocks + self._blocks_of(num_prompt_tokens) <= self.budget
        if not self._blocked and (self.charged_blocks == 0 or fits):
            self.deferred.discard(request_id)
            return True
        self._blocked = True
        self.deferred.add(request_id)
        return False

    def allocated(self, request_id: str, base_id: str, num_prompt_tokens: int) -> bool:
        """vLLM allocated the request's blocks: a claim is consumed, else the
        request is charged. Returns False when it was charged past the
        budget (vLLM scheduled it without asking, as it does for requests
        that skip the prefix cache, e.g. with prompt_logprobs)."""
        self._forget_asked(request_id)
        if request_id in self._charged:
            return True
        if self._claimed.pop(base_id, None) is not None:
            return True
        n = self._blocks_of(num_prompt_tokens)
        within = self.charged_blocks == 0 or self.charged_blocks + n <= self.budget
        self._charged[request_id] = (base_id, n)
        self.charged_blocks += n
        return within

    def finished(self, request_id: str, held: bool) -> None:
        """request_finished: a request that holds no blocks (held False)
        ends its charge; a held one's ends with its hold."""
        self.deferred.discard(request_id)
        self._forget_asked(request_id)
        if not held:
            self._release(request_id)
        elif request_id in self._charged:
            self._holds[request_id] = self._clock()

    def hold_ended(self, request_ids: Iterable[str]) -> None:
        """finished_sending: these requests' blocks are free."""
        for rid in request_ids:
            self._release(rid)

    def _forget_asked(self, request_id: str) -> None:
        b = self._asked.pop(request_id, None)
        if b is not None:
            left = self._asking[b] - 1
            if left:
                self._asking[b] = left
            else:
                del self._asking[b]

    def _release(self, request_id: str) -> None:
        got = self._charged.pop(request_id, None)
        if got is not None:
            self.charged_blocks -= got[1]
        self._holds.pop(request_id, None)

    def _expire(self, now: float) -> None:
        """Claims older than memory whose base no request waits for, and
        holds older than hold_limit; oldest first, amortised O(1)."""
        horizon = now - self._memory
        for _ in range(len(self._claimed)):
            b, t = next(iter(self._claimed.items()))
            if t >= horizon:
                break
            if b in self._asking:
                self._claimed.move_to_end(b)  # a request of this base waits: kept
                continue
            del self._claimed[b]
        horizon = now - self._hold_limit
        while self._holds:
            rid, t = next(iter(self._holds.items()))
            if t >= horizon:
                break
            self._release(rid)
            self.expired.append(rid)

    def tick(self) -> None:
        """Runs the expiries without an arrival (a step's output)."""
        self._expire(self._clock())
