"""The chunked gated delta rule's per-chunk operands, before its loop over chunk steps.

Everything the chunked (WY) form computes for each chunk on its own, before the states
carry from chunk to chunk (:func:`hybridkv.ops.gated_delta_rule.paged._chunks` runs that
loop): the in-chunk decays, the inverse of the unit lower-triangular ``T``, and the
chunk's ``w``, ``u``, decayed queries and keys. Two forms run it: eagerly beside the loop,
and exported into a package compiled ahead of time
(:mod:`hybridkv.ops.gated_delta_rule.packaged_chunks`), where its ~hundred small ops are
one call; so it is written as a pure function of its tensors (its in-place ops act on its
own intermediates only).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from hybridkv.ops.exp import decay_exp_
from hybridkv.ops.gated_delta_rule.naive import l2norm


def prepare_rows(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32 rows, q and k l2-normalised (still on their Hk heads), q scaled by 1/sqrt(Dk)."""
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    return q, l2norm(k.float()), v.float(), g.float(), beta.float()


def per_v_head(x: Tensor, v_heads: int) -> Tensor:
    """[..., Hk, ...] -> [..., Hv, ...] along dim 1 (value head h reads k-head h // r)."""
    rep = v_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


INVERSE_BLOCK = 16  # unit_lower_inverse solves blocks up to this size directly
SOLVE_ROWS = 512  # ... and whole batches of at most this many rows (matrices x n)


def unit_lower_inverse(t: Tensor) -> Tensor:
    """Inverse of a batch of unit lower-triangular matrices [..., n, n].

    The chunked form needs ``T^-1 V`` and ``T^-1 K`` for the same ``T``; one inverse and two
    matmuls cost less than two batched triangular solves on CPU, where the solves run at a
    few GFLOP/s on 64x64 matrices. The inverse is built by halves (``[[A, 0], [C, B]]^-1 =
    [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``), so most of its work is matmuls too; blocks of up to
    :data:`INVERSE_BLOCK` rows are solved directly. transformers' chunked form also applies
    an explicit inverse, built row by row.

    A small batch (a short prefill's one chunk) is solved directly whatever its size: the
    halves' dozen ops cost more than the solve there (one thread, interleaved: 4 matrices of
    32: 20 vs 42 us; of 64: 65 vs 113 us; 32 matrices of 64: 490 vs 300 us).
    """
    n = t.shape[-1]
    if n <= INVERSE_BLOCK or t[..., 0, 0].numel() * n <= SOLVE_ROWS:
        eye = torch.eye(n, dtype=t.dtype, device=t.device).expand(t.shape)
        return torch.linalg.solve_triangular(t, eye, upper=False, unitriangular=True)
    half = n // 2
    first = unit_lower_inverse(t[..., :half, :half])
    second = unit_lower_inverse(t[..., half:, half:])
    out = torch.zeros_like(t)
    out[..., :half, :half] = first
    out[..., half:, half:] = second
    out[..., half:, :half] = (second @ t[..., half:, :half] @ first).neg_()
    return out


class ChunkOperands(NamedTuple):
    """What the loop over chunk steps reads, for every chunk (N chunks, C rows each)."""

    w: Tensor  # [N, Hv, C, Dk]
    u: Tensor  # [N, Hv, C, Dv]
    q: Tensor  # [N, Hv, C, Dk] decayed from the chunk's start
    intra: Tensor  # [N, Hv, C, C] in-chunk attention, decayed
    k_end: Tensor  # [N, Hv, Dk, C] keys decayed to the chunk's end, transposed
    end_decay: Tensor  # [N, Hv, 1, 1]
    k: Tensor  # [N, Hk, 1, C, Dk] (captures inside a chunk read these three)
    decay: Tensor  # [N, Hv, C, C]
    cum: Tensor  # [N, Hv, C] cumulative log decays


def chunk_operands(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, upper: Tensor
) -> ChunkOperands:
    """The operands of chunks q, k [N, Hk, C, Dk], v [N, Hv, C, Dv], g (log decay), beta
    [N, Hv, C] (prepared rows, :func:`prepare_rows`, zero-padded into chunks); ``upper``
    [C, C] bool, True above the diagonal. ``v`` is scaled in place.

    q·k and k·k are computed once per k-head and shared by its value heads (grouped as
    [N, Hk, r, ...] views of the value-head tensors).
    """
    num_chunks, k_heads, size, k_dim = k.shape
    heads = v.shape[1]
    grouped = (num_chunks, k_heads, heads // k_heads, size)  # value heads by k-head

    cum = g.cumsum(dim=-1)  # [N, Hv, C]
    decay = decay_exp_(cum[..., :, None] - cum[..., None, :], upper)  # exp(cum_i - cum_j), i >= j
    decay_g = decay.view(*grouped, size)  # [N, Hk, r, C, C]
    kk = (k @ k.transpose(-1, -2))[:, :, None]  # [N, Hk, 1, C, C]
    ut = (kk * decay_g).mul_(beta.view(*grouped, 1)).view_as(decay)  # unit lower-triangular
    intra = ((q @ k.transpose(-1, -2))[:, :, None] * decay_g).view_as(decay)
    k_g = k[:, :, None]  # [N, Hk, 1, C, Dk]
    ut_inv = unit_lower_inverse(ut)
    u = ut_inv @ v.mul_(beta[..., None])
    start_decay = decay_exp_(cum.clone())  # [N, Hv, C]
    w = ut_inv @ (k_g * (beta * start_decay).view(*grouped, 1)).view(-1, heads, size, k_dim)
    q = (q[:, :, None] * start_decay.view(*grouped, 1)).view(-1, heads, size, k_dim)
    to_end = decay_exp_(cum[..., -1:] - cum).view(*grouped, 1)
    k_end = (k_g * to_end).view(-1, heads, size, k_dim).transpose(-1, -2).contiguous()
    end_decay = start_decay[..., -1, None, None]  # [N, Hv, 1, 1]
    return ChunkOperands(w, u, q, intra, k_end, end_decay, k_g, decay, cum)
