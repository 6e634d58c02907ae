"""decay_exp_: exp of log decays on the fast path, equal to exp wherever exp is normal."""

from __future__ import annotations

import math

import torch

from hybridkv.ops.exp import EXP_FLOOR, decay_exp_


def test_equals_exp_where_the_result_is_normal() -> None:
    x = torch.linspace(EXP_FLOOR, 0.0, 10_001)
    assert torch.equal(decay_exp_(x.clone()), x.exp())


def test_tiny_decays_stay_tiny_and_positive() -> None:
    x = torch.tensor([-87.5, -95.0, -104.0, -1e4, -math.inf])
    got = decay_exp_(x.clone())
    assert torch.equal(got, torch.full_like(x, math.exp(EXP_FLOOR)))
    assert got.max() < 2e-38


def test_the_upper_mask_zeroes_whatever_was_there() -> None:
    cum = -torch.rand(3, 8).cumsum(-1) * 30  # down to about -120
    upper = torch.ones(8, 8, dtype=torch.bool).triu(1)
    diff = cum[:, :, None] - cum[:, None, :]  # positive above the diagonal
    got = decay_exp_(diff.clone(), upper)
    assert torch.all(got[:, upper] == 0)
    want = diff.masked_fill(upper, -math.inf).exp()  # the plain form
    assert torch.allclose(got, want, rtol=0, atol=2e-38)
    normal = want > 2e-38  # the exp itself wherever it is a normal number
    assert torch.equal(got[normal], want[normal])


def test_nan_stays_nan() -> None:
    got = decay_exp_(torch.tensor([math.nan, -1.0]))
    assert math.isnan(got[0]) and got[1] == math.exp(-1.0)
