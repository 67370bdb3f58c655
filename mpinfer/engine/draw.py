"""How a sampling row's token is drawn, and the prefix sums of a row, in blocks.

A row of BLOOM's 250,880 probabilities has its CDF inverted at a uniform number (sampling.py
makes the number from the request's seed and the token's index). One scan over a whole row is,
on a GPU, one long sequential scan per row (torch's scan keeps a row in one thread block); here
the sums are taken in blocks of DRAW_BLOCK tokens side by side, then the blocks' sums, which
costs the same at any batch (docs/performance.md, round 10).
"""

from __future__ import annotations

import torch

DRAW_BLOCK = 1024  # tokens a block


def prefix_sums(x: torch.Tensor) -> torch.Tensor:
    """x.cumsum(-1) of rows (n, V), as each block of DRAW_BLOCK values' own prefix sums plus the
    sums of the blocks before it: n x V / DRAW_BLOCK short scans side by side instead of n long
    ones (the order of the additions differs from one scan's, by rounding only)."""
    n, V = x.shape
    blocks = torch.nn.functional.pad(x, (0, -V % DRAW_BLOCK)).view(n, -1, DRAW_BLOCK).cumsum(-1)
    ends = blocks[:, :, -1].cumsum(-1)  # (n, blocks)
    blocks[:, 1:] += ends[:, :-1, None]  # in place: no more memory than one scan's result
    return blocks.view(n, -1)[:, :V]


def draw(processed: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token at uniform u (n,) of its distribution: the first index where the CDF
    passes u (a token with probability 0 is never chosen). Sums are float64: in float32 a
    250k-token sum drifts by ~1e-5, enough to move a draw to a neighbouring token between a
    CPU's sequential sum and a GPU's scan; in float64 the order of a sum moves a draw only at a
    boundary within ~1e-16 of u.

    Two levels: the block where the CDF passes u (from the blocks' sums), then the token within
    it (from that block's prefix sums, offset by the blocks before it). Rounding can leave the
    target at or past the end of a block's sums; the last token of positive probability before
    that point is taken then, never a removed one."""
    n, V = processed.shape
    probs = processed.softmax(-1)
    pad = -V % DRAW_BLOCK
    blocks = torch.nn.functional.pad(probs, (0, pad)).view(n, -1, DRAW_BLOCK)
    mass = blocks.sum(-1, dtype=torch.float64)  # (n, blocks)
    ends = mass.cumsum(-1)
    at = u.to(torch.float64) * ends[:, -1]
    b = torch.searchsorted(ends, at[:, None], right=True)[:, 0]
    b = torch.minimum(b, last_positive(mass))
    local = blocks.gather(1, b[:, None, None].expand(n, 1, DRAW_BLOCK))[:, 0]  # (n, DRAW_BLOCK)
    before = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    within = torch.searchsorted(local.double().cumsum(-1), (at - before)[:, None], right=True)
    return b * DRAW_BLOCK + torch.minimum(within[:, 0], last_positive(local))


def last_positive(x: torch.Tensor) -> torch.Tensor:
    """Per row of x (n, m), the last index holding a positive value (0 when none)."""
    idx = torch.arange(x.shape[1], device=x.device)
    return torch.where(x > 0, idx, 0).amax(-1)
