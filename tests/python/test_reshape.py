"""gonixl.engine.BlockReshaper: blocks read from a prefill of a smaller
block size, put in the decode's token order, for every layout it knows.

The library's READ leaves each decode block holding `ratio` prefill blocks
one after another (their bytes verbatim). Here that READ is emulated with
torch on real tensors: a prefill cache with block size bs/ratio is filled
with known K/V by token position in the layout's own byte order, its blocks
are concatenated into the decode's blocks, and after the reshaper every
token must be where the decode's layout puts it, with the positions the
READ did not write zeroed. No vLLM needed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gonixl.engine import BlockReshaper  # noqa: E402

HEADS, DIM = 3, 8


# Each layout: (cache shape for num_blocks and block size, kind, write
# [tokens, heads, 2, dim] into block b, read it back).
def _shape(kind: str, nb: int, bs: int) -> tuple[int, ...]:
    return {
        "head_major": (nb, HEADS, bs, DIM),  # HND, one tensor for K (or V)
        "token_major": (nb, bs, HEADS, DIM),  # NHD
        "cpu_vec": (nb, HEADS, bs, 2 * DIM),  # vLLM CPU: K column-major, V row-major per head
    }[kind]


def _set(kind: str, t, b: int, x) -> None:
    """x: [tokens, heads, 2, dim] (only K, x[:, :, 0], for the one-tensor layouts)."""
    bs = x.shape[0]
    if kind == "head_major":
        t[b] = x[:, :, 0].permute(1, 0, 2)
    elif kind == "token_major":
        t[b] = x[:, :, 0]
    else:
        blk = t[b].view(HEADS, 2, bs * DIM)
        blk[:, 0] = x[:, :, 0].permute(1, 2, 0).reshape(HEADS, DIM * bs)
        blk[:, 1] = x[:, :, 1].permute(1, 0, 2).reshape(HEADS, bs * DIM)


def _get(kind: str, t, b: int, bs: int):
    if kind == "head_major":
        return t[b].permute(1, 0, 2)
    if kind == "token_major":
        return t[b]
    blk = t[b].reshape(HEADS, 2, bs * DIM)
    k = blk[:, 0].reshape(HEADS, DIM, bs).permute(2, 0, 1)
    v = blk[:, 1].reshape(HEADS, bs, DIM).permute(1, 0, 2)
    return torch.stack([k, v], dim=2)


@pytest.mark.parametrize("kind", ["head_major", "token_major", "cpu_vec"])
@pytest.mark.parametrize("ratio,tokens", [(2, 13), (4, 16), (4, 9)])
def test_reshape_puts_every_token_in_place(kind, ratio, tokens):
    bs, nb = 8, 6
    rbs = bs // ratio
    remote = torch.zeros(_shape(kind, 16, rbs))
    local = torch.full(_shape(kind, nb, bs), -5.0)
    gen = torch.Generator().manual_seed(ratio * 100 + tokens)
    n_remote = -(-tokens // rbs)
    logical = torch.randn(n_remote * rbs, HEADS, 2, DIM, generator=gen)
    rblocks = [11, 3, 7, 1, 14, 2, 9, 5][:n_remote]
    for k, rb in enumerate(rblocks):
        _set(kind, remote, rb, logical[k * rbs : (k + 1) * rbs])
    lblocks = [4, 1][: -(-n_remote // ratio)]
    # The READ: remote block k into sub-block k % ratio of local block k // ratio.
    sub = local[0].numel() // ratio
    flat_local, flat_remote = local.view(nb, -1), remote.view(16, -1)
    for k, rb in enumerate(rblocks):
        flat_local[lblocks[k // ratio], (k % ratio) * sub : (k % ratio + 1) * sub] = flat_remote[rb]
    untouched = local[0].clone()

    r = BlockReshaper({"layer": local}, nb, bs, DIM, kind)
    assert r.mode == kind
    r.apply([{"ratio": ratio, "blocks": lblocks, "covered": n_remote}])

    width = 2 if kind == "cpu_vec" else 1
    for j, lb in enumerate(lblocks):
        got = _get(kind, local, lb, bs)
        want = torch.zeros(bs, HEADS, width, DIM)
        n = min(bs, n_remote * rbs - j * bs)
        want[:n] = logical[j * bs : j * bs + n, :, :width]
        assert torch.equal(got.reshape(want.shape), want), f"local block {lb}"
    assert torch.equal(local[0], untouched), "a block outside the request changed"


def test_unknown_layouts_are_refused_not_guessed():
    t = torch.zeros(4, HEADS, 8, DIM)
    assert BlockReshaper({"l": t}, 4, 8, DIM, "").mode == ""
    # A tensor without a block dimension, or a block whose size does not
    # fit the kind: no reshaping (the library then refuses other block sizes).
    assert BlockReshaper({"l": torch.zeros(3, 5)}, 4, 8, DIM, "head_major").mode == ""
    assert BlockReshaper({"l": torch.zeros(4, HEADS, 8, DIM + 1)}, 4, 8, DIM, "cpu_vec").mode == ""
    # Strided (non-dense) blocks.
    wide = torch.zeros(4, HEADS, 8, 2 * DIM)[..., :DIM]
    assert BlockReshaper({"l": wide}, 4, 8, DIM, "head_major").mode == ""
