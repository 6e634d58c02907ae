"""A memo of values derived from tensors: per identity and key, dropped with its tensors."""

from __future__ import annotations

import torch

from hybridkv.ops.tensor_memo import TensorMemo, missing


def test_remembered_per_tensors_and_key_until_one_is_freed() -> None:
    memo: TensorMemo[int] = TensorMemo()
    a, b = torch.zeros(2), torch.ones(3)
    calls: list[str] = []

    def derive(tag: str) -> int:
        calls.append(tag)
        return len(calls)

    assert memo.get((a, b), lambda: derive("ab")) == 1
    assert memo.get((a, b), lambda: derive("again")) == 1  # remembered
    assert memo.get((a, b), lambda: derive("key"), key="other") == 2  # another key
    assert memo.get((b, a), lambda: derive("ba")) == 3  # order matters
    assert missing(memo.lookup((a,)))
    assert (a, b) in memo and len(memo) == 3
    del a  # every entry holding a goes; a tensor later at its id starts afresh
    assert len(memo) == 0
    c = torch.zeros(2)
    assert memo.get((c, b), lambda: derive("c")) == 4


def test_remember_stores_a_given_value() -> None:
    memo: TensorMemo[str] = TensorMemo()
    x = torch.zeros(1)
    assert memo.remember((x,), "v") == "v"
    assert memo.lookup((x,)) == "v"
