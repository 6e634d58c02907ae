"""StateBatch: capture validation, chunk lengths, the workspace, the differentiable path."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_varlen
from hybridkv.ops.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_varlen
from hybridkv.ops.paged_state import StateBatch, StateCaptures
from hybridkv.ops.state_layouts import choose_chunk_tokens
from hybridkv.ops.workspace import Workspace

STARTS, PAGES = [0, 5, 6, 9], torch.tensor([4, 0, 2])


@pytest.mark.parametrize(
    ("rows", "pages", "message"),
    [
        ([2, 9], [1, 3], "outside"),
        ([2, 3], [1, 1], "repeat"),
        ([2], [0], "live state page"),
        ([2, 3], [1], "capture pages"),
    ],
)
def test_bad_captures_are_rejected(rows: list[int], pages: list[int], message: str) -> None:
    captures = StateCaptures(torch.tensor(rows), torch.tensor(pages))
    with pytest.raises(ValueError, match=message):
        StateBatch(STARTS, PAGES, [True] * 3, captures)


def test_captures_split_into_final_and_interior() -> None:
    captures = StateCaptures(torch.tensor([4, 5, 0, 7]), torch.tensor([1, 3, 5, 6]))
    states = StateBatch(STARTS, PAGES, [True] * 3, captures)
    assert states.final_captures is not None
    src, dst = states.final_captures
    assert src.tolist() == [4, 0] and dst.tolist() == [1, 3]  # last rows of requests 0, 1
    assert states.interior_captures() == [(0, 0, 5), (2, 1, 6)]


@pytest.mark.parametrize(
    ("lens", "max_chunk", "want"),
    [([3, 5], 64, 16), ([17, 2], 64, 32), ([50], 64, 64), ([200, 1], 64, 64), ([5], 8, 8)],
)
def test_chunk_shrinks_to_the_longest_request(lens: list[int], max_chunk: int, want: int) -> None:
    assert choose_chunk_tokens(lens, max_chunk) == want


def test_workspace_buffers_grow_and_are_reused() -> None:
    space = Workspace()
    a = space.get("s", (4, 8), torch.float32, torch.device("cpu"))
    b = space.get("s", (2, 8), torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr()  # same memory, smaller view
    c = space.get("s", (8, 8), torch.float32, torch.device("cpu"))
    assert c.shape == (8, 8) and space.get("t", (2,), torch.float32, c.device).numel() == 2


def test_workspace_views_are_reused_until_their_buffer_grows() -> None:
    """The same shape gives the same view again (no ops); once a larger shape regrows the
    buffer, every shape's view is of the new buffer; the cache of views stays bounded."""
    from hybridkv.ops import workspace

    space, cpu = Workspace(), torch.device("cpu")
    a = space.get("s", (4, 8), torch.float32, cpu)
    assert space.get("s", (4, 8), torch.float32, cpu) is a
    big = space.get("s", (16, 8), torch.float32, cpu)  # regrows the buffer
    again = space.get("s", (4, 8), torch.float32, cpu)
    assert again is not a and again.data_ptr() == big.data_ptr() and again.shape == (4, 8)
    for n in range(workspace.MAX_VIEWS + 5):
        assert space.get("s", (1, n % 16 + 1), torch.float32, cpu).shape == (1, n % 16 + 1)
        space.get("u", (n + 1,), torch.float32, cpu)
    assert len(space._views()) <= workspace.MAX_VIEWS


def test_workspace_buffers_used_in_inference_mode_stay_writable_outside_it() -> None:
    """The engine runs its forward in inference mode; an op called afterwards outside it
    (a test, a reference run) must not get an inference tensor to write into."""
    space = Workspace()
    with torch.inference_mode():
        inside = space.get("s", (4, 8), torch.float32, torch.device("cpu"))
        inside.fill_(1.0)
    outside = space.get("s", (4, 8), torch.float32, torch.device("cpu"))
    assert torch.is_inference(inside) and not torch.is_inference(outside)
    outside.fill_(2.0)  # an inference tensor would raise here
    with torch.inference_mode():
        assert space.get("s", (4, 8), torch.float32, torch.device("cpu")).eq(1.0).all()


def test_inputs_requiring_grad_take_the_differentiable_path() -> None:
    """Training through the serving layers (the demo model): outputs and gradients equal
    the references', and the final states still land in the pages."""
    gen = torch.Generator().manual_seed(0)
    lens, hk, hv, dim = [5, 1, 9], 1, 2, 4
    total = sum(lens)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    x = torch.randn(total, 3, generator=gen, requires_grad=True)
    weight = torch.randn(3, 4, generator=gen, requires_grad=True)
    q, k = (torch.randn(total, hk, dim, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(total, hv, dim, generator=gen, requires_grad=True)
    g, beta = -torch.rand(total, hv, generator=gen), torch.rand(total, hv, generator=gen)
    conv_pages, ssm_pages = torch.zeros(4, 3, 3), torch.zeros(4, hv, dim, dim)
    states = StateBatch(starts, torch.tensor([3, 0, 1]), [False] * 3)

    y = causal_conv1d_varlen(x, conv_pages, states, weight, None, "silu")
    o = gated_delta_rule_varlen(q, k, v, g, beta, ssm_pages, states)
    (y.square().sum() + o.square().sum()).backward()
    got = [t.grad.clone() for t in (x, weight, q, k, v)]
    for t in (x, weight, q, k, v):
        t.grad = None
    want_loss = torch.zeros(())
    for r, page in enumerate([3, 0, 1]):
        rows = slice(starts[r], starts[r + 1])
        y_r, conv_state = causal_conv1d_fn(x[rows], weight, None, None, "silu")
        o_r, ssm_state = chunk_gated_delta_rule(
            q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows]
        )
        torch.testing.assert_close(conv_pages[page], conv_state.detach())
        torch.testing.assert_close(ssm_pages[page], ssm_state[0].detach())
        want_loss = want_loss + y_r.square().sum() + o_r.square().sum()
    want_loss.backward()
    for got_grad, t in zip(got, (x, weight, q, k, v), strict=True):
        torch.testing.assert_close(got_grad, t.grad)
