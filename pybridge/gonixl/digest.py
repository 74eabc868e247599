"""Token digests for bidirectional KV transfer (vLLM-free).

In a multi-turn conversation the decode holds the KV of the earlier turns
(prompt and output) and returns kv_transfer_params with which the prefill of
the next turn pulls that KV back. vLLM assumes the decode's tokens are a
prefix of the new prompt; a client that edits the history (drops a reasoning
trace, rewrites a message) breaks that, and the prefill would compute the new
tokens on KV of other tokens: a wrong answer with HTTP 200.

A gonixl decode adds a digest of the tokens its blocks hold to those params
(READBACK_DIGEST_KEY). A gonixl prefill compares it with its own prompt and
pulls only the leading tokens that match (READBACK_TOKENS_KEY, read by the Go
scheduler), possibly none. The digest is a chain of BLAKE2b states over the
token ids (little-endian int64): one 8-byte checkpoint every `step` tokens
(a multiple of the block size, so that a matched prefix ends on a block
boundary) and a 16-byte digest of all n tokens. A prefix matches when its
checkpoint matches; all n tokens match when the final digest does. The first
differing token therefore costs at most the tokens back to the checkpoint
before it; it never lets KV of a differing token through (up to a 2^-64
collision of an 8-byte checkpoint).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from typing import Any, Optional, Sequence

READBACK_DIGEST_KEY = "gonixl_token_digest"
READBACK_TOKENS_KEY = "gonixl_readback_tokens"
DIGEST_VERSION = 1
DIGEST_INTERVAL_TOKENS = 256
_PERSON = b"gonixl-kv-tokens"


def _step(block_size: int) -> int:
    bs = max(1, int(block_size))
    return bs * max(1, -(-DIGEST_INTERVAL_TOKENS // bs))


def _hasher(digest_size: int) -> Any:
    return hashlib.blake2b(digest_size=digest_size, person=_PERSON)


def token_bytes(token_ids: Sequence[int], n: int) -> bytes:
    """token_ids[:n] as little-endian int64s, the bytes every token digest
    hashes. struct.pack reads a list of ints in a third of the time
    array.array does (7 against 18 us at 1,000 tokens), and a decode
    digests every prompt it pulls on its scheduler thread."""
    ids = token_ids if n == len(token_ids) else token_ids[:n]
    return struct.pack(f"<{len(ids)}q", *ids)


def token_digest(token_ids: Sequence[int], n: int, block_size: int) -> Optional[dict[str, Any]]:
    """The digest of token_ids[:n] (None when n is not in 1..len(token_ids))."""
    if n <= 0 or n > len(token_ids):
        return None
    step = _step(block_size)
    data = token_bytes(token_ids, n)
    chain = _hasher(8)
    final = _hasher(16)
    ckpts = bytearray()
    for off in range(step, n + 1, step):
        piece = data[(off - step) * 8 : off * 8]
        chain.update(piece)
        final.update(piece)
        ckpts += chain.digest()
    final.update(data[(n // step) * step * 8 :])
    ckpt = base64.b64encode(bytes(ckpts)).decode()
    return {"v": DIGEST_VERSION, "n": n, "step": step, "ckpt": ckpt, "final": final.hexdigest()}


class DigestError(ValueError):
    """A token digest that cannot be read (corrupt, or another version)."""


def matched_tokens(digest: Any, token_ids: Sequence[int]) -> int:
    """How many leading tokens of token_ids are the tokens the digest covers.

    Returns a multiple of the digest's step, or its n when every covered
    token matches. Raises DigestError for a digest it cannot read.
    """
    if not isinstance(digest, dict) or digest.get("v") != DIGEST_VERSION:
        raise DigestError(f"unknown token digest {str(digest)[:80]!r}")
    n, step, final = digest.get("n"), digest.get("step"), digest.get("final")
    if not isinstance(n, int) or not isinstance(step, int) or n <= 0 or step <= 0 or not isinstance(final, str):
        raise DigestError("token digest without a valid n, step or final")
    try:
        ckpts = base64.b64decode(digest.get("ckpt", ""), validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise DigestError(f"token digest checkpoints: {e}") from None
    if len(ckpts) != 8 * (n // step):
        raise DigestError(f"token digest has {len(ckpts) // 8} checkpoints for {n} tokens in steps of {step}")
    m = min(len(token_ids), n)
    data = token_bytes(token_ids, m)
    chain = _hasher(8)
    final_h = _hasher(16)
    matched = 0
    for k, off in enumerate(range(step, m + 1, step)):
        piece = data[(off - step) * 8 : off * 8]
        chain.update(piece)
        if chain.digest() != ckpts[8 * k : 8 * k + 8]:
            return matched
        final_h.update(piece)
        matched = off
    if len(token_ids) >= n:
        final_h.update(data[matched * 8 : n * 8])
        if final_h.hexdigest() == final:
            return n
    return matched
