"""Reference gated delta rule (Gated DeltaNet, Yang et al. 2024, arXiv:2412.06464).

Per value head, with state ``S`` of shape [Dk, Dv] (the transformers/FLA layout)::

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T
    o_t = S_t^T q_t / sqrt(Dk)

q and k are l2-normalised first (in fp32, eps 1e-6, as FLA does). Everything runs in fp32
whatever the input dtype; the state comes back in fp32 and the caller casts it to the page
dtype. The chunked form is the one transformers runs for a full forward (chunk 64), so an
unsplit prefill matches it to rounding; the recurrent form is the one-token decode.
Grouped heads: value head h reads q/k head ``h // (Hv // Hk)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, use_qk_l2norm: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32, heads expanded to Hv, layout [B, H, n, ...], q scaled by 1/sqrt(Dk)."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, g, beta = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q, k, v, g, beta)
    )
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """Token-by-token form (decode).

    Args:
        q, k: [B, n, Hk, Dk]; v: [B, n, Hv, Dv]; g (log decay, <= 0), beta: [B, n, Hv].
        initial_state: [B, Hv, Dk, Dv] or None for zeros.

    Returns:
        (o [B, n, Hv, Dv] in v's dtype, final_state [B, Hv, Dk, Dv] fp32)
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    batch, heads, n, k_dim = k.shape
    state = q.new_zeros(batch, heads, k_dim, v.shape[-1])
    if initial_state is not None:
        state = initial_state.to(torch.float32).clone()
    out = torch.zeros_like(v)  # [B, H, n, Dv]
    for t in range(n):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t, :, None]).sum(dim=-2)  # [B, H, Dv]
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunked (WY / UT-transform) form for prefill; same arguments and results as recurrent."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    batch, heads, n, k_dim = k.shape
    pad = (chunk_size - n % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (
        x.reshape(batch, heads, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    cum = g.reshape(batch, heads, -1, chunk_size).cumsum(dim=-1)  # [B, H, N, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C], unit lower-triangular system
    intra = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    state = q.new_zeros(batch, heads, k_dim, v.shape[-1])
    if initial_state is not None:
        state = initial_state.to(torch.float32).clone()
    out = torch.zeros_like(u)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    for i in range(q.shape[2]):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, v.shape[-1])[:, :, :n]
    return out.transpose(1, 2).contiguous().to(out_dtype), state
