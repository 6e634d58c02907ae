"""LFM2's gated short convolution: ``out_proj(C * conv(B * x))``, its conv state in a page.

::

    in_proj(x) = [B | C | x]        # [T, 3H], chunked in this order
    y = causal_conv1d(B * x)        # depthwise, kernel L (conv_L_cache), no activation
    out = out_proj(C * y)           # conv state: last L-1 values of B * x, [H, L-1]

The state is the last ``L-1`` *gated inputs* ``B * x`` of the request; a request whose
``has_initial_state`` is False starts from zeros. Names follow the checkpoints
(``conv.conv.weight``, ``conv.in_proj.weight``, ``conv.out_proj.weight``).
"""

from __future__ import annotations

from torch import Tensor, nn

from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.ops.causal_conv1d import causal_conv1d_varlen


class ShortConv(nn.Module):
    """One LFM2 conv layer's mixer: ``forward(x [T, H], batch, views) -> [T, H]``."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel, groups=hidden_size, bias=bias)
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: Tensor, batch: ForwardBatch, views: CacheViews) -> Tensor:
        view = views.state(self.layer_index)
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # [T, H] each
        y = causal_conv1d_varlen(
            b * h,
            view["conv"],
            batch.state_batch(view.group_id),
            self.conv.weight[:, 0, :],  # [H, L]
            self.conv.bias,
            None,
        )  # [T, H]
        return self.out_proj(c * y)
