"""Training the demo model through the serving model code itself.

The layers of the serving model run with autograd over a fresh dense cache arena per batch
(every sequence a fresh request of one prefill chunk), so the weights are trained by
exactly the function that serves them and no second implementation can drift from it.
Its gradients equal transformers' (tests/demo).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridkv.core.layout import ArenaLayout, build_layout
from hybridkv.core.spec import ModelSpec
from hybridkv.forward.batch import ForwardBatch
from hybridkv.forward.views import CacheViews
from hybridkv.models.base import CausalLM


def init_weights(model: nn.Module, seed: int) -> None:
    """transformers' Qwen3.5 init from a private generator (global RNG untouched).

    Matrices N(0, 0.02); zero-centred norms 0; GDN ``A_log = log U(1, 16)``, ``dt_bias = 1``;
    the depthwise conv keeps PyTorch's kaiming-uniform bound 1/sqrt(kernel).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(param.shape[-1])
                param.copy_(torch.rand(param.shape, generator=gen) * 2 * bound - bound)
            elif name.endswith("A_log"):
                param.copy_(torch.log(1 + 15 * torch.rand(param.shape, generator=gen)))
            elif param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            # 1-d parameters keep their construction values: norms 0 / 1, dt_bias 1


def dense_batch(spec: ModelSpec, seq_tokens: int, num_seqs: int) -> tuple[ForwardBatch, CacheViews]:
    """A prefill batch of ``num_seqs`` fresh sequences of ``seq_tokens`` and a zeroed arena.

    One page per attention layer holds a whole sequence (block = seq_tokens); every group
    takes whole chunks of the layout, so no two groups' pages share bytes. All rows return
    logits. ``input_ids`` is a placeholder: callers set it per batch.
    """
    probe = build_layout(spec.groups, seq_tokens, 1 << 40)
    num_chunks = {
        g.group_id: -(-num_seqs // probe.pages_per_chunk(g.group_id)) for g in spec.groups
    }
    layout = build_layout(spec.groups, seq_tokens, probe.chunk_bytes * sum(num_chunks.values()))
    pages, first_chunk = {}, 0
    for group in spec.groups:
        gid = group.group_id
        ids = [_page(layout, gid, first_chunk, r) for r in range(num_seqs)]
        pages[gid] = torch.tensor(ids)
        first_chunk += num_chunks[gid]
    batch = ForwardBatch(
        input_ids=torch.zeros(num_seqs * seq_tokens, dtype=torch.int64),
        positions=torch.arange(seq_tokens).repeat(num_seqs),
        query_start_loc=torch.arange(num_seqs + 1) * seq_tokens,
        num_computed_tokens=torch.zeros(num_seqs, dtype=torch.int64),
        block_tables={
            g.group_id: pages[g.group_id][:, None] for g in spec.groups if not g.is_recurrent
        },
        state_pages={g.group_id: pages[g.group_id] for g in spec.groups if g.is_recurrent},
        logits_indices=torch.arange(num_seqs * seq_tokens),
    )
    views = CacheViews(spec, layout, torch.zeros(layout.total_bytes, dtype=torch.uint8))
    return batch, views


def _page(layout: ArenaLayout, group_id: int, first_chunk: int, index: int) -> int:
    per_chunk = layout.pages_per_chunk(group_id)
    return layout.first_page(group_id, first_chunk + index // per_chunk) + index % per_chunk


def train_logits(model: CausalLM, batch: ForwardBatch, views: CacheViews) -> Tensor:
    """``CausalLM.forward`` without its ``no_grad``: [T, vocab] logits with autograd.

    The layers write K/V and states into the arena in place; autograd records those writes
    (the arena is rebuilt for every batch), so the gradients are those of the serving path.
    """
    hidden = model.embed(batch)  # [T, H]
    for layer in model.model.layers:
        hidden = layer(hidden, batch, views)
    return model.compute_logits(model.model.norm(hidden[batch.logits_indices]))


def train(
    model: CausalLM,
    spec: ModelSpec,
    stream: Tensor,
    doc_starts: Tensor,
    *,
    seed: int,
    num_steps: int,
    batch_seqs: int,
    seq_tokens: int,
    learning_rate: float,
    progress: bool,
    stop_after: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    """AdamW with warm-up and cosine decay on windows that start at document starts.

    Args:
        stop_after: run only the first steps of the ``num_steps`` schedule (the cheap
            fingerprint of a recipe: its first steps, exactly as the full run takes them).
        on_step: called with the number of steps done after each step.

    Returns:
        the training loss of every step run.
    """
    gen = torch.Generator().manual_seed(seed + 2)
    length, rows = seq_tokens, batch_seqs
    starts = doc_starts[doc_starts <= stream.numel() - length - 1]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.01
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(num_steps))
    losses: list[float] = []
    model.train()
    steps = num_steps if stop_after is None else min(stop_after, num_steps)
    with _progress_bar(progress, steps) as advance:
        for step in range(steps):
            offsets = starts[torch.randint(len(starts), (rows,), generator=gen)]
            window = stream[offsets[:, None] + torch.arange(length + 1)]  # [rows, length + 1]
            batch, views = dense_batch(spec, length, rows)
            batch.input_ids = window[:, :-1].flatten()
            loss = F.cross_entropy(train_logits(model, batch, views), window[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            advance(losses[-1])
            if on_step is not None:
                on_step(step + 1)
    model.eval()
    return losses


def _lr_factor(num_steps: int) -> Any:
    warmup = max(1, num_steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, num_steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return factor


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int) -> Iterator[Any]:
    """Yields ``advance(loss)``; a rich bar on stderr when enabled, a no-op otherwise."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("building the hybridkv demo model"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), disable=not enabled) as bar:
        task = bar.add_task("train", total=total, loss=float("nan"))
        yield lambda loss: bar.update(task, advance=1, loss=loss)


@torch.no_grad()
def evaluate(model: CausalLM, spec: ModelSpec, sequences: Sequence[Sequence[int]]) -> float:
    """Mean next-token loss over ``sequences``, each a fresh request, through the model."""
    total, count = 0.0, 0
    for ids in sequences:
        batch, views = dense_batch(spec, len(ids) - 1, 1)
        batch.input_ids = torch.tensor(ids[:-1])
        logits = model(batch, views)
        total += float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    return total / count
