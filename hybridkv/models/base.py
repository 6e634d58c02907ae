"""The decoder-LM skeleton every architecture shares, and weight loading by name.

A model is ``embed -> layers -> norm -> lm_head`` over a flat token batch; an architecture
supplies its decoder layers and, when its checkpoint names differ from its module names,
:meth:`CausalLM.remap_weight_name`. Logits are computed only for ``batch.logits_indices``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hybridkv.core.spec import ModelSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.layers.fp32_matmul import upcast_tied_pair


class DecoderStack(nn.Module):
    """``model.*`` in the checkpoints: embeddings, layers, final norm."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[nn.Module], norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """Base of every architecture: forward over a ForwardBatch, load weights by name.

    Subclasses build ``self.model`` (a :class:`DecoderStack`) in ``__init__`` with
    :meth:`build_model`. Each decoder layer is called as ``layer(hidden [T, H], batch, views)``.
    """

    model: DecoderStack
    # Where a parameter still on the meta device is materialised by load_weights.
    materialize_device: torch.device = torch.device("cpu")

    def __init__(self, cfg: Mapping[str, Any], spec: ModelSpec) -> None:
        super().__init__()
        self.cfg = cfg
        self.spec = spec
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))

    def build_model(self, layers: list[nn.Module], norm: nn.Module) -> None:
        """``self.model`` from the decoder layers and the final norm, then the LM head."""
        vocab, hidden = int(self.cfg["vocab_size"]), int(self.cfg["hidden_size"])
        self.model = DecoderStack(vocab, hidden, layers, norm)
        self.finish_init(vocab, hidden)

    def finish_init(self, vocab_size: int, hidden_size: int) -> None:
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def upcast_weights(self) -> int:
        """A tied LM head and its embedding onto one fp32 table (the loader's fp32 matmuls
        of a bf16 / fp16 model, :mod:`hybridkv.layers.fp32_matmul`; the other linears are
        converted module by module). Returns 1 if it converted them, else 0."""
        if not self.tie_word_embeddings:
            return 0
        embedding, head = upcast_tied_pair(self.model.embed_tokens, self.lm_head)
        if head is self.lm_head:
            return 0
        self.model.embed_tokens, self.lm_head = embedding, head
        return 1

    def embed(self, batch: ForwardBatch) -> Tensor:
        """[T, H] input embeddings (Zamba2/Falcon-H1 override to scale or keep them)."""
        return self.model.embed_tokens(batch.input_ids)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[R, H] final hidden states -> [R, vocab] fp32 logits."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, views: CacheViews) -> Tensor:
        """One step: logits [R, vocab] (fp32) of the rows ``batch.logits_indices``."""
        hidden = self.embed(batch)  # [T, H]
        for layer in self.model.layers:
            hidden = layer(hidden, batch, views)
        hidden = self.model.norm(hidden[batch.logits_indices])  # [R, H]
        return self.compute_logits(hidden)

    # ------------------------------------------------------------------ weights

    def remap_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> parameter name, or None to skip the tensor."""
        return name

    def split_weight(self, name: str, tensor: Tensor) -> Iterable[tuple[str, Tensor]]:
        """Hook to turn one checkpoint tensor into several (e.g. fused experts)."""
        yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters (cast to their dtype).

        A parameter on the meta device (built by the loader's ``parameters_on_meta``) is
        materialised from its tensor in its dtype on :attr:`materialize_device` (the
        tensor itself when it already is that, so no copy is made).

        Raises:
            KeyError: a checkpoint tensor has no parameter, or a parameter got no tensor.
            ValueError: a shape mismatch.
        """
        params: dict[str, nn.Parameter] = dict(self.named_parameters())
        views = self.checkpoint_views()
        loaded: set[str] = set()
        for raw_name, raw_tensor in weights:
            name = self.remap_weight_name(raw_name)
            if name is None or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            for part_name, tensor in self.split_weight(name, raw_tensor):
                if part_name in views:
                    owner, index = views[part_name]
                    _copy_into_param(
                        params[owner], index, part_name, tensor, self.materialize_device
                    )
                else:
                    _copy_param(params, part_name, tensor, self.materialize_device)
                loaded.add(part_name)
        parts: dict[str, list[str]] = {}
        for name, (owner, _) in views.items():
            parts.setdefault(owner, []).append(name)
        loaded |= {owner for owner, names in parts.items() if loaded.issuperset(names)}
        missing = set(params) - loaded
        if self.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise KeyError(f"checkpoint has no tensor for {sorted(missing)[:8]} ...")

    def checkpoint_views(self) -> dict[str, tuple[str, tuple[int | slice, ...]]]:
        """Checkpoint names stored inside a bigger parameter -> (its name, the index of the
        part in it).

        Modules with a ``checkpoint_views()`` method (the stacked experts of
        :class:`~hybridkv.layers.moe.GroupedExperts`) map local names to (local parameter
        name, index); a checkpoint holds either the whole parameter or all its parts.
        """
        found: dict[str, tuple[str, tuple[int | slice, ...]]] = {}
        for prefix, module in self.named_modules():
            method = getattr(module, "checkpoint_views", None)
            if module is self or not callable(method):
                continue
            for local, (param, index) in method().items():
                found[f"{prefix}.{local}"] = (f"{prefix}.{param}", index)
        return found


def _copy_into_param(
    param: nn.Parameter,
    index: tuple[int | slice, ...],
    name: str,
    tensor: Tensor,
    device: torch.device,
) -> None:
    """Copy a checkpoint tensor into the part ``param[index]`` (a meta ``param`` is first
    materialised, uninitialised, on ``device``: its other parts come from other tensors)."""
    if param.is_meta:
        real = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device=device), param.requires_grad
        )
        torch.utils.swap_tensors(param, real)
    part = param.data[index]
    if part.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(part.shape)}")
    part.copy_(tensor.to(param.dtype))


def _copy_param(
    params: dict[str, nn.Parameter], name: str, tensor: Tensor, device: torch.device
) -> None:
    if name not in params:
        raise KeyError(f"checkpoint tensor {name!r} matches no parameter")
    param = params[name]
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(param.shape)}")
    if param.is_meta:  # swap in place: every module sharing this Parameter sees it
        real = nn.Parameter(tensor.to(device=device, dtype=param.dtype), param.requires_grad)
        torch.utils.swap_tensors(param, real)
    else:
        param.data.copy_(tensor.to(param.dtype))
