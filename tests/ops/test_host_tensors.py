"""Index tensors built through typed buffers equal ``torch.tensor`` of the same lists."""

from __future__ import annotations

import gc

import pytest
import torch

from hybridkv.ops.host_tensors import bool_tensor, long_matrix, long_tensor


@pytest.mark.parametrize("values", [[], [0], [3, -1, 2**40], list(range(300))])
def test_long_tensor_equals_torch_tensor(values: list[int]) -> None:
    got = long_tensor(values)
    want = torch.tensor(values, dtype=torch.int64)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(long_tensor(iter(values), "cpu"), want)  # any iterable, a device


def test_long_tensor_outlives_its_buffer_and_owns_it() -> None:
    """The tensor keeps the array it wraps alive, and writing to it changes no other."""
    made = [long_tensor(range(i, i + 50)) for i in range(20)]
    gc.collect()
    [x.add_(1) for x in made[:10]]
    assert all(torch.equal(x, torch.arange(i + 1, i + 51)) for i, x in enumerate(made[:10]))
    assert all(torch.equal(x, torch.arange(i, i + 50)) for i, x in enumerate(made) if i >= 10)


def test_long_matrix_rows_and_shape_check() -> None:
    rows = [[1, 2, 3], [4, 5, 6]]
    assert torch.equal(long_matrix(rows, 3), torch.tensor(rows))
    assert long_matrix([], 4).shape == (0, 4)
    assert long_matrix([[], []], 0).shape == (2, 0)
    with pytest.raises(ValueError, match="5 values for 2 rows of 3"):
        long_matrix([[1, 2, 3], [4, 5]], 3)


@pytest.mark.parametrize("values", [[], [True], [False, True, True, False]])
def test_bool_tensor_equals_torch_tensor(values: list[bool]) -> None:
    got = bool_tensor(values)
    assert got.dtype == torch.bool and torch.equal(got, torch.tensor(values, dtype=torch.bool))
