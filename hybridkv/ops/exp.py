"""exp of log decays, kept on the CPU's fast path whatever their range.

The chunked recurrent forms (Gated DeltaNet, Mamba2's SSD) build their in-chunk decays as
``exp`` of differences of cumulative log decays, which reach far below -87 in
fast-decaying heads (half the entries of a random test model's chunks; the fast heads of
trained ones). The CPU's vectorised ``exp`` takes a slow path for every argument whose
result is not a normal fp32 number: 28x slower where the result is subnormal
(-103 < x < -87), 10x where it underflows to 0 or is the exp of -inf (one thread, 131k
elements: 92 us in [-80, 0], 2,585 us in [-95, -90], 1,012 us in [-300, -200]).

So the arguments are clamped to [EXP_FLOOR, 0] first: a decay below exp(-87) = 1.6e-38
comes out as 1.6e-38 instead of a subnormal or 0, below any term it is added to by 30
orders of magnitude, and a log decay is never above 0. The part above the diagonal is
zeroed after the exp (as -inf before it, it took the slow path too). The in-chunk decays
of 64 chunks x 8 heads x 64 x 64 (a 4,096-token GDN prefill) from such a model: 12.5 ->
2.7 ms; with every decay in the fast range: 5.0 -> 2.9 ms.
"""

from __future__ import annotations

from torch import Tensor

EXP_FLOOR = -87.0  # exp(-87) = 1.6e-38: the smallest argument with a normal fp32 result


def decay_exp_(log_decay: Tensor, upper: Tensor | None = None) -> Tensor:
    """``exp`` of log decays (<= 0) in place, arguments below ``EXP_FLOOR`` taken as
    ``EXP_FLOOR``; then 0 wherever the bool mask ``upper`` (broadcast) is True. NaN stays
    NaN. Returns the tensor."""
    log_decay.clamp_(EXP_FLOOR, 0.0).exp_()
    if upper is not None:
        log_decay.masked_fill_(upper, 0.0)
    return log_decay
