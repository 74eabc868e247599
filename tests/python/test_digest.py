"""gonixl.digest: the decode's token digest and the prefill's prefix match (bidirectional turns)."""

from __future__ import annotations

import array
import random

import pytest
from gonixl.digest import DigestError, matched_tokens, token_bytes, token_digest


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(n)]


@pytest.mark.parametrize("block_size", [16, 32, 48, 256, 1000])
@pytest.mark.parametrize("n", [1, 31, 256, 257, 1000, 4096])
def test_unchanged_history_matches_every_token(n, block_size):
    held = tokens(n + 50, n)  # the decode's prompt and output
    d = token_digest(held, n, block_size)
    assert d is not None and d["n"] == n and d["step"] % block_size == 0
    # The next turn's prompt: the held tokens, then new ones.
    assert matched_tokens(d, held[:n] + tokens(40, 7)) == n
    assert matched_tokens(d, held[:n]) == n


@pytest.mark.parametrize("edit", [0, 1, 255, 256, 300, 511, 512, 999])
def test_edited_history_matches_only_up_to_the_checkpoint_before_the_edit(edit):
    n, bs = 1000, 32
    held = tokens(n, 1)
    d = token_digest(held, n, bs)
    assert d is not None
    step = d["step"]
    prompt = held + tokens(30, 2)
    prompt[edit] = prompt[edit] + 1
    got = matched_tokens(d, prompt)
    assert got == (edit // step) * step
    assert got <= edit and got % bs == 0


def test_shorter_prompt_matches_whole_checkpoints_only():
    n, bs = 1000, 32
    held = tokens(n, 3)
    d = token_digest(held, n, bs)
    step = d["step"]
    for m in (0, 10, step, step + 5, 3 * step + 1, n - 1):
        assert matched_tokens(d, held[:m]) == (m // step) * step


def test_removed_token_shifts_everything_after_it():
    # A stripped reasoning trace: tokens removed from the middle.
    held = tokens(800, 4)
    d = token_digest(held, 800, 16)
    step = d["step"]
    prompt = held[:300] + held[340:] + tokens(50, 5)
    assert matched_tokens(d, prompt) == (300 // step) * step


def test_out_of_range_n_gives_no_digest():
    assert token_digest([1, 2, 3], 0, 16) is None
    assert token_digest([1, 2, 3], 4, 16) is None


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(v=2),
        lambda d: d.update(n="10"),
        lambda d: d.update(step=0),
        lambda d: d.update(ckpt="!!not base64!!"),
        lambda d: d.update(ckpt=""),  # too few checkpoints for n
        lambda d: d.pop("final"),
    ],
)
def test_unreadable_digest_is_an_error(mutate):
    held = tokens(600, 6)
    d = token_digest(held, 600, 32)
    mutate(d)
    with pytest.raises(DigestError):
        matched_tokens(d, held)
    with pytest.raises(DigestError):
        matched_tokens("not a dict", held)


def test_forged_final_digest_matches_only_checkpoints():
    held = tokens(600, 8)
    d = token_digest(held, 600, 32)
    d["final"] = "00" * 16
    assert matched_tokens(d, held) == (600 // d["step"]) * d["step"]


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_token_bytes_are_the_int64s_every_digest_was_made_of(n):
    # Digests cross processes (a prefill's prompt digest, a decode's token
    # digest): the bytes hashed must stay what array("q") wrote before.
    ids = [random.randrange(1 << 62) for _ in range(n)] + [0, (1 << 63) - 1, 5]
    assert token_bytes(ids, n) == array.array("q", ids[:n]).tobytes()
    assert token_bytes(ids, len(ids)) == array.array("q", ids).tobytes()
    assert token_bytes(tuple(ids), n) == array.array("q", ids[:n]).tobytes()
    with pytest.raises(Exception):
        token_bytes([1, 1 << 64], 2)
