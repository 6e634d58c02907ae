"""A decode's whole Gated DeltaNet mixer between its projections, as one compiled step.

Between its input and output projections, one token of a GDN mixer eagerly is some sixty
small ops: the conv update (gather the carried inputs, four taps, shift, write back), the
SiLU, the q/k l2 norms, the gates, the recurrence and the gated RMSNorm. At decode sizes
each costs more in dispatch than in arithmetic; compiled (:mod:`hybridkv.ops.compiled`)
they are one C++ function that reads each request's conv and SSM state from its pages
once and writes them back. Against the layer's former eager ops (with the recurrence
compiled on its own), alternating steps in one process, one thread: the small Qwen3-Next
of issue 13 (6 GDN layers of 1,024 conv channels, 8 value heads of 64 x 64, bf16) 3.8%
less per decode step at 8 requests and 1.8% at 64; the tests' tiny Qwen3.5 (fp32) 9% and
0.6% (benchmarks/README.md).

Every decode of every eager forward runs here, the decode rows of mixed steps as well as
decode-only steps (a model with a decode graph runs its decode-only steps there instead,
this step inlined in a larger compiled graph: hybridkv.models.decode_graph), and its
result does not depend on what shares its step (tested for the compiled form: a row
alone, in a batch, among a mixed step's rows, the same bits); the eager form
(``enforce_eager``, no compiler, other devices) is the layer's former ops, whose ATen
kernels can round a row differently with the batch's size, as before. Three things make
the graph fast and single: the page views are marked static, so head sizes compile as
constants (with every size symbolic the same graph ran 2-3x slower); the batch size is
unbacked, so a lone decode runs the same graph; and q, k, v are returned beside the
result, so inductor computes them once (see the fused form).

The warm-up first loads the step compiled ahead of time for its page layout
(:mod:`hybridkv.ops.ahead_of_time`: a package built once per machine and layout, loaded
without the compiler), and decodes over those views call it; the just-in-time graph
above serves any other views and wherever no package can be built or loaded. The two
compiled forms are one function but not one code, so they round differently; each is
batch-invariant, and an engine keeps its form for its life.

The SSM states are read through an alias of their own storage
(:func:`_reading_alias`) and written through the view: read through the tensor it
writes, inductor would write the new states to a temporary and copy them in a second
pass. Their write needs the reduction over the same states (``S^T k``), which inductor
computes in one pass with ``S^T q``, so both reads come first (the compiled-vs-eager test
would see them reordered). The conv states are read and written through one tensor, an
alias too (two mutated inputs over one storage are what dynamo cannot compile): read
through another, their write, which needs nothing but the values read, could run before
the conv sums read them. Each row needs a page of its own, which the engine's decodes
have (parallel samples copy their state at admission).
"""

from __future__ import annotations

import ctypes
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridkv.ops import ahead_of_time
from hybridkv.ops.ahead_of_time import AheadOfTimeStep
from hybridkv.ops.causal_conv1d.paged import conv_decode
from hybridkv.ops.compiled import CompiledOp
from hybridkv.ops.gated_delta_rule import chunk_operands, naive, paged
from hybridkv.ops.gated_delta_rule.chunk_operands import per_v_head, prepare_rows
from hybridkv.ops.gated_delta_rule.naive import l2norm
from hybridkv.ops.gated_delta_rule.paged import decode_in_pages
from hybridkv.ops.gated_norm import gated_rms_norm
from hybridkv.ops.paged_state import DecodeRows
from hybridkv.ops.row_copy import index_copy_rows
from hybridkv.ops.tensor_memo import TensorMemo

# rows of the warm-up's batch: a size no model dimension has (dynamo ties sizes that are
# equal when it traces)
WARM_UP_BATCH = 13


class MixerWeights(NamedTuple):
    """A GDN layer's parameters the decode step reads (its projections stay outside)."""

    conv: Tensor  # [C, 1, K] depthwise conv weight (no bias)
    a_log: Tensor  # [Hv]
    dt_bias: Tensor  # [Hv]
    norm: Tensor  # [Dv] gated RMSNorm weight
    norm_eps: float


def gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(g, beta) of GDN rows from their projections ``a``, ``b`` [T, Hv]: the log decay
    ``-exp(A_log) * softplus(a + dt_bias)`` in fp32 and the write strength ``sigmoid(b)``
    in ``b``'s dtype (transformers' roundings)."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


class StepViews(NamedTuple):
    """The page views a step reads and writes (which through which: module doc)."""

    conv: Tensor  # [P, C, K-1] conv states, read and written
    ssm: Tensor  # [P, Hv, Dk, Dv] SSM states, written
    ssm_source: Tensor  # the SSM states' memory, read


class StepParams(NamedTuple):
    """:class:`MixerWeights` as the step takes them (the epsilon a 0-d tensor), and the
    conv's taps as the fused form reads them."""

    conv: Tensor  # [C, 1, K]: the eager form's
    a_log: Tensor
    dt_bias: Tensor
    norm: Tensor
    eps: Tensor
    # [K, C] fp32, contiguous (conv_taps): the fused form's. Taken from ``conv`` inside the
    # compiled step, their stride of K along the channels kept inductor from vectorising
    # the conv over them (it folds a .contiguous() into the loads)
    conv_taps: Tensor


def conv_taps(conv_weight: Tensor) -> Tensor:
    """A depthwise conv weight [C, 1, K] as the fused steps read it: [K, C] in fp32,
    contiguous, a plain tensor (not an inference one) whatever the caller's mode."""
    with torch.inference_mode(False), torch.no_grad():
        return conv_weight[:, 0, :].detach().float().T.contiguous()


def _mixer_decode_fused(
    x: Tensor,
    z: Tensor,
    b: Tensor,
    a: Tensor,
    pages: Tensor,
    fresh: Tensor,
    views: StepViews,
    params: StepParams,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decodes' mixer outputs [B, Hv * Dv] in ``x``'s dtype, their states updated
    (and their q, k [B, Hv, Dk] and v [B, Hv, Dv] in fp32, below).

    ``x`` [B, C] (the conv's input), ``z`` [B, Hv, Dv], ``b``, ``a`` [B, Hv]: the decodes'
    projections, contiguous; ``pages`` [B] their live pages,
    ``fresh`` [B] bool: start from zeros (masked, never multiplied: NaN garbage in a fresh
    page stays out). ``views``: the pages read and written, ``params`` the layer's
    weights. Each op rounds where the
    eager layer does: the conv sums in fp32 tap by tap (newest input first, then the carried
    ones oldest first) rounded to the model dtype before the SiLU, beta rounded there
    too, the recurrence in fp32, its output rounded before the gated norm.
    """
    conv_view, ssm_view, ssm_source = views
    _, a_log, dt_bias, norm_weight, eps, taps = params  # taps [K, C] fp32
    heads, k_dim, v_dim = ssm_view.shape[1:]
    keep = conv_view.shape[2]
    key_dim = (conv_view.shape[1] - heads * v_dim) // 2
    k_heads = key_dim // k_dim

    # read through the tensor written below: nothing else orders this read before that
    # write (an alias would let the write, which needs only these values, run first)
    carried = conv_view[pages].masked_fill(fresh[:, None, None], 0.0)  # [B, C, K-1]
    acc = x.float() * taps[keep]
    for tap in range(keep):
        acc = acc + carried[:, :, tap].float() * taps[tap]
    conv_view[pages] = torch.cat([carried[:, :, 1:], x[:, :, None].to(conv_view.dtype)], dim=2)
    y = F.silu(acc.to(x.dtype))

    # unflatten, not reshape: a reshape of an unbacked batch makes inductor guard its size
    q = l2norm(y[:, :key_dim].unflatten(1, (k_heads, k_dim)).float()) * k_dim**-0.5
    k = l2norm(y[:, key_dim : 2 * key_dim].unflatten(1, (k_heads, k_dim)).float())
    v = y[:, 2 * key_dim :].unflatten(1, (heads, v_dim)).float()
    q, k = per_v_head(q, heads), per_v_head(k, heads)
    g, beta = gates(a, b, a_log, dt_bias)
    beta = beta.float()

    # S' = d S + k delta^T with delta = beta (v - d S^T k), and S'^T q = d S^T q + (k . q)
    # delta: both reads of S are one pass over it, the write of S' a second
    state = ssm_source[pages].float().masked_fill(fresh[:, None, None, None], 0.0)
    decay = g.exp()[..., None]  # [B, Hv, 1]
    s_k = (state * k[..., None]).sum(-2)  # [B, Hv, Dv]
    s_q = (state * q[..., None]).sum(-2)
    delta = (v - decay * s_k) * beta[..., None]
    out = decay * s_q + (k * q).sum(-1, keepdim=True) * delta
    new_state = state * decay[..., None] + k[..., None] * delta[..., None, :]
    ssm_view[pages] = new_state.to(ssm_view.dtype)

    # the gated norm as gated_rms_norm, its epsilon a 0-d tensor: a float argument makes
    # dynamo trace it symbolic, fail and start over (~1.4 s more at each start-up)
    o = out.to(x.dtype).float()
    normed = norm_weight * (o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    gated = (normed * F.silu(z.float())).to(x.dtype)
    # q, k and v returned too, though no caller reads them: a graph's outputs are buffers,
    # computed once, where inductor would otherwise recompute the conv and the norms that
    # make them inside the state loops, for every value column (64 decodes of the small
    # Qwen3-Next: 1,208 -> 1,036 us a layer, cold pages)
    return gated.flatten(1), q, k, v


def _mixer_decode_eager(
    x: Tensor,
    z: Tensor,
    b: Tensor,
    a: Tensor,
    pages: Tensor,
    fresh: Tensor,
    views: StepViews,
    params: StepParams,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_mixer_decode_fused` from the layer's eager ops (the conv's decode step, the
    eager recurrence, the gated norm; the views' ``ssm_source`` unused): where compiling is off or
    fails. The same bits as the layer's former decode-only steps (tested)."""
    conv_view, ssm_view, _ = views
    conv_weight, a_log, dt_bias, norm_weight, eps, _ = params
    heads, k_dim, v_dim = ssm_view.shape[1:]
    key_dim = (conv_view.shape[1] - heads * v_dim) // 2
    decodes = DecodeRows(rows=pages, pages=pages, fresh=fresh)  # (rows: unused)
    y = conv_decode(x, conv_view, decodes, conv_weight[:, 0, :], None, "silu")
    batch = y.shape[0]
    q, k, v = y.split([key_dim, key_dim, heads * v_dim], dim=-1)
    g, beta = gates(a, b, a_log, dt_bias)
    q, k, v, g, beta = prepare_rows(
        q.reshape(batch, -1, k_dim), k.reshape(batch, -1, k_dim), v.reshape(batch, heads, v_dim),
        g, beta,
    )  # fmt: skip
    q, k = per_v_head(q, heads).contiguous(), per_v_head(k, heads).contiguous()
    out = decode_in_pages(ssm_view, pages, fresh, q, k, v.contiguous(), g, beta)
    gated = gated_rms_norm(out.to(x.dtype), z, norm_weight, float(eps)).flatten(1)
    return gated, q, k, v


_mixer_decode = CompiledOp(_mixer_decode_fused, _mixer_decode_eager)

# the gated norm's epsilons as 0-d tensors (the fused form's argument), one per value
_EPSILONS: dict[float, Tensor] = {}
# per conv weight: its taps as the fused form reads them (conv_taps)
_TAPS: TensorMemo[Tensor] = TensorMemo()

# per page view, role and mode: a tensor over the view's memory (_reading_alias)
_READ_ALIASES: TensorMemo[Tensor] = TensorMemo()


def _reading_alias(view: Tensor, role: str = "read") -> Tensor:
    """``view``'s memory as a tensor of its own storage object, for the compiled step to
    read or write the states through (module doc); each role an alias of its own. Made
    from the address with ``torch.frombuffer``: it owns nothing, and is remembered only
    while ``view`` (which keeps the memory) lives. Views of one storage object would not
    do: torch 2.13 compiles aliased inputs against a synthetic base whose size its guards
    do not check (a second arena of another size then failed at run time). CPU only: the
    step runs its eager form elsewhere."""
    storage = view.untyped_storage()

    def derive() -> Tensor:
        memory = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
        flat = torch.frombuffer(memory, dtype=torch.uint8).view(view.dtype)
        return flat.as_strided(view.shape, view.stride(), view.storage_offset())

    key = (role, torch.is_inference_mode_enabled(), storage.data_ptr(), storage.nbytes())
    return _READ_ALIASES.get((view,), derive, key)


def _compiles(*views: Tensor) -> bool:
    """Whether the step runs compiled on these page views: while compiling is on, on CPU
    views whose storage is whole elements of their dtype (where the aliases can be made)."""
    return _mixer_decode.will_compile() and all(
        v.device.type == "cpu"
        and v.numel() > 0
        and v.untyped_storage().nbytes() % v.element_size() == 0
        for v in views
    )


# per decodes' pages: an all-False fresh mask (the graph always takes one: dynamo would
# compile another for None)
_NONE_FRESH: TensorMemo[Tensor] = TensorMemo()


def _static_sizes(*tensors: Tensor) -> None:
    """Compile every size of these long-lived tensors (page views and their aliases) as a
    constant except the first (their number of pages); marked once per tensor."""
    for t in tensors:
        if not hasattr(t, "_dynamo_static_indices"):
            for dim in range(1, t.dim()):
                torch._dynamo.mark_static(t, dim)


def _unbacked_batch(*tensors: Tensor) -> None:
    """The decodes' batch size (these tensors' first) as an unbacked size: one graph for
    a batch of any size, one included (dynamo would specialise a size of one)."""
    for t in tensors:
        if not hasattr(t, "_dynamo_unbacked_indices"):
            torch._dynamo.decorators.mark_unbacked(t, 0)


class _ExportedStep(torch.nn.Module):
    """:func:`_mixer_decode_fused` over flat tensors, as :func:`torch.export.export` takes
    a function (the package's inputs, in :func:`_flat_inputs` order)."""

    def forward(
        self,
        x: Tensor,
        z: Tensor,
        b: Tensor,
        a: Tensor,
        pages: Tensor,
        fresh: Tensor,
        conv: Tensor,
        ssm: Tensor,
        ssm_source: Tensor,
        conv_weight: Tensor,
        a_log: Tensor,
        dt_bias: Tensor,
        norm: Tensor,
        eps: Tensor,
        taps: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        views = StepViews(conv, ssm, ssm_source)
        params = StepParams(conv_weight, a_log, dt_bias, norm, eps, taps)
        return _mixer_decode_fused(x, z, b, a, pages, fresh, views, params)


# what the step's code is made of (a change to one is a new package)
_SOURCES = (sys.modules[__name__], chunk_operands, naive, paged)
# the package's inputs with a dynamic first size: the decodes' six, the views' three
_DYNAMIC_FIRST = (True,) * 9 + (False,) * 6


class _LoadedStep(NamedTuple):
    """A package of the step and the dtypes of the per-step inputs it was built for."""

    step: AheadOfTimeStep
    dtypes: tuple[torch.dtype, ...]  # x, z, b, a, pages, fresh


# per (conv write alias, SSM view, SSM read alias): the step loaded ahead of time at
# warm-up (views without an entry, never warmed up or without a package, take the
# just-in-time form). Not per thread count: a package built for one runs correctly on
# another (its rows are independent), and an engine keeps one form for its life
_AHEAD: TensorMemo[_LoadedStep] = TensorMemo()


def _flat_inputs(
    inputs: list[Tensor], pages: Tensor, fresh: Tensor, views: StepViews, params: StepParams
) -> tuple[Tensor, ...]:
    return (*inputs, pages, fresh, *views, *params)


def _load_ahead_of_time(flat: tuple[Tensor, ...], views: StepViews) -> None:
    """Load (or build, the first time on this machine) the package of the step over these
    views and remember it for them (:mod:`hybridkv.ops.ahead_of_time`)."""
    key = ahead_of_time.package_key("gdn-mixer-decode", _SOURCES, flat, _DYNAMIC_FIRST)

    def export() -> torch.export.ExportedProgram:
        batch, num_pages = torch.export.Dim("batch", min=1), torch.export.Dim("pages", min=1)
        shapes = ({0: batch},) * 6 + ({0: num_pages},) * 3 + (None,) * 6
        return torch.export.export(_ExportedStep(), flat, dynamic_shapes=shapes)

    step = ahead_of_time.load_or_build(key, export)
    if step is not None:
        _AHEAD.remember(tuple(views), _LoadedStep(step, tuple(t.dtype for t in flat[:6])))


def _run_ahead_of_time(
    flat: tuple[Tensor, ...], views: StepViews
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """The step's outputs from its package, or None where none serves these views and
    inputs (the caller compiles just in time). A package checks nothing of its inputs
    (reading a strided ``pages`` as contiguous would update other requests' states), so the
    per-step inputs must have the dtypes it was built for and be contiguous, as the
    engine's are: ``index_select`` results and the step's own index tensors."""
    loaded = _AHEAD.lookup(tuple(views))
    if not isinstance(loaded, _LoadedStep):
        return None
    batch = flat[:6]
    if tuple(t.dtype for t in batch) != loaded.dtypes or not all(t.is_contiguous() for t in batch):
        return None
    out = loaded.step(*flat)
    return out[0], out[1], out[2], out[3]


def compiled_ahead_of_time(conv_pages: Tensor, ssm_pages: Tensor) -> bool:
    """Whether the engine's decodes (inference mode) over these page views run the step
    loaded ahead of time (tests)."""
    if not _compiles(conv_pages, ssm_pages):
        return False
    with torch.inference_mode():  # the aliases are per mode
        views = (_reading_alias(conv_pages, "write"), ssm_pages, _reading_alias(ssm_pages))
    return isinstance(_AHEAD.lookup(views), _LoadedStep)


def _step_params(weights: MixerWeights) -> StepParams:
    """The weights as the step takes them, the epsilon a 0-d tensor made once per value
    and the conv's taps once per weight."""
    eps = _EPSILONS.get(weights.norm_eps)
    if eps is None:  # a plain tensor, whatever the mode of the step that makes it
        with torch.inference_mode(False):
            eps = _EPSILONS[weights.norm_eps] = torch.tensor(weights.norm_eps)
    taps = _TAPS.get((weights.conv,), lambda: conv_taps(weights.conv))
    return StepParams(weights.conv, weights.a_log, weights.dt_bias, weights.norm, eps, taps)


def gated_deltanet_decode(
    qkv: Tensor,
    z: Tensor,
    b: Tensor,
    a: Tensor,
    decodes: DecodeRows,
    conv_pages: Tensor,
    ssm_pages: Tensor,
    weights: MixerWeights,
) -> Tensor:
    """The mixer outputs [B, Hv * Dv] of a step's decodes (``decodes.rows`` of the step's
    projections ``qkv`` [T, C], ``z`` [T, Hv, Dv], ``b``, ``a`` [T, Hv]), their conv and
    SSM states updated in their pages. Captures are the caller's: every capture of a
    decode is at its last row (``StateBatch.copy_final_captures`` after this call)."""
    rows, pages, fresh = decodes
    if fresh is None:
        fresh = _NONE_FRESH.get(
            (pages,), lambda: torch.zeros(pages.shape, dtype=torch.bool, device=pages.device)
        )
    # picked even when every row is a decode: the graph is compiled for rows of standard
    # strides, which a projection's split (or contiguous() of one row) does not give
    inputs = [t.index_select(0, rows) for t in (qkv, z, b, a)]
    params = _step_params(weights)
    if not _compiles(conv_pages, ssm_pages):
        eager_views = StepViews(conv_pages, ssm_pages, ssm_pages)
        out, *_ = _mixer_decode.eager(*inputs, pages, fresh, eager_views, params)
        return out
    views = StepViews(_reading_alias(conv_pages, "write"), ssm_pages, _reading_alias(ssm_pages))
    if _AHEAD:  # a package was loaded for some views (cheaper to ask than to look them up)
        ahead = _run_ahead_of_time(_flat_inputs(inputs, pages, fresh, views, params), views)
        if ahead is not None:
            return ahead[0]
    _static_sizes(*views)
    _unbacked_batch(*inputs, pages, fresh)
    out, *_ = _mixer_decode(*inputs, pages, fresh, views, params)
    return out


def warm_up_mixer_decode(conv_pages: Tensor, ssm_pages: Tensor, weights: MixerWeights) -> None:
    """Compile the decode step for these page views and weights before serving, on the
    views' first pages, whose bytes are put back (a poisoned cache stays poisoned); the
    projections zeros of the weights' dtype. No-op where the step runs eagerly."""
    if not _compiles(conv_pages, ssm_pages):
        return
    device, dtype = conv_pages.device, weights.conv.dtype
    heads, _, v_dim = ssm_pages.shape[1:]
    channels = conv_pages.shape[1]
    with torch.inference_mode():  # as the engine's steps: dynamo compiles per mode
        batch = min(WARM_UP_BATCH, conv_pages.shape[0], ssm_pages.shape[0])
        pages = torch.arange(batch, device=device)
        saved = conv_pages.index_select(0, pages), ssm_pages.index_select(0, pages)
        num_rows = batch + 2  # rows of the decodes and of some prefill beside them
        rows = torch.arange(batch, device=device) + 1
        qkv = torch.zeros(num_rows, channels, dtype=dtype, device=device)
        z = torch.zeros(num_rows, heads, v_dim, dtype=dtype, device=device)
        b, a = (torch.zeros(num_rows, heads, dtype=dtype, device=device) for _ in range(2))
        decodes = DecodeRows(rows=rows, pages=pages, fresh=None)
        if ahead_of_time.available() and batch >= 2:  # (an example batch of 2 at least)
            views = StepViews(
                _reading_alias(conv_pages, "write"), ssm_pages, _reading_alias(ssm_pages)
            )
            inputs = [t.index_select(0, rows) for t in (qkv, z, b, a)]
            fresh = torch.zeros(pages.shape, dtype=torch.bool, device=device)
            flat = _flat_inputs(inputs, pages, fresh, views, _step_params(weights))
            _load_ahead_of_time(flat, views)
        gated_deltanet_decode(qkv, z, b, a, decodes, conv_pages, ssm_pages, weights)
        index_copy_rows(conv_pages, pages, saved[0])
        index_copy_rows(ssm_pages, pages, saved[1])
