"""Load a Hugging Face checkpoint directory: config, layer specs, weights, tokenizer.

The config is read once: :func:`hybridkv.core.model_config.model_spec_from_config` gives the
cache specs (the same ones the planner counts), and the flattened text config builds the
modules. Lean loading: the modules are built with their parameters on the meta device (no
memory, no random init; buffers such as RoPE frequencies are computed for real), then each
parameter is materialised from its safetensors tensor, in the target dtype on the target
device, as the shards stream by; a tensor already in that dtype is used as read, without a
copy. So peak host memory is about the model in the target dtype plus one tensor, not a
random fp32 model beside the checkpoint (issue #15: 3.98 GiB against transformers' 1.92
GiB for Qwen3.5-0.8B in bf16; benchmarks/load_memory.py measures it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from hybridkv.core.model_config import flatten_text_config, model_spec_from_config
from hybridkv.core.spec import ModelSpec, canonical_dtype
from hybridkv.core.units import GIB
from hybridkv.forward.views import TORCH_DTYPES
from hybridkv.layers.fp32_matmul import upcast_extra_bytes, upcast_linears
from hybridkv.layers.packed_linear import pack_linears, packing_threshold
from hybridkv.models.base import CausalLM
from hybridkv.models.registry import model_class
from hybridkv.models.tokenizer import Tokenizer
from hybridkv.ops.cpu_gemm import native_gemm

MODEL_DTYPES = ("float32", "bfloat16", "float16")
# what a bf16 / fp16 model multiplies its matmul weights in (load_model's matmul_dtype)
MATMUL_DTYPES = ("auto", "model", "float32")

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: Tokenizer | None  # None when the directory has no tokenizer.json
    config: dict[str, Any]  # the text config (VLM wrappers flattened)
    dtype: str  # the model dtype chosen ("auto" resolved)

    @property
    def nbytes(self) -> int:
        """Bytes of the model's parameters as loaded (fp32 matmul copies included)."""
        return parameter_bytes(self.model)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters (each shared one once), from their shapes and dtypes:
    the same on meta as loaded."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def resolve_dtype(dtype: str, device: str, raw_config: dict[str, Any]) -> str:
    """ "auto": float32 on CPU (bf16 matmuls are slow there), else the checkpoint's dtype."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    text = raw_config.get("text_config") or raw_config
    named = (
        text.get("torch_dtype")
        or text.get("dtype")
        or raw_config.get("torch_dtype")
        or raw_config.get("dtype")
    )
    return named if named in MODEL_DTYPES else "bfloat16"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the shards of ``model.safetensors.index.json`` or every *.safetensors.

    Raises:
        FileNotFoundError: no safetensors file in the directory.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_safetensors(
    files: list[Path], progress: bool = False, mapped: bool = True
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every tensor, one at a time, so peak memory stays one tensor.

    ``mapped``: tensors are views of the memory-mapped file (no copy; a page is read when
    first used); else each is read into memory of its own, so nothing stays mapped once
    the caller drops it (weights that are repacked right after loading).
    ``progress``: a bar over the shards on stderr.
    """
    with _shard_progress(progress, len(files)) as advance:
        for path in files:
            if mapped:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        yield name, f.get_tensor(name)
            else:
                yield from _read_safetensors(path)
            advance()


_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _read_safetensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of one safetensors file read (not mapped) into a buffer of its own.

    The format: an 8-byte little-endian header length, a JSON header of ``{name: {dtype,
    shape, data_offsets: [begin, end]}}`` (offsets after the header), then the data.
    """
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        entries = [(n, e) for n, e in header.items() if n != "__metadata__"]
        for name, entry in sorted(entries, key=lambda item: item[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            data = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(base + begin)
            if f.readinto(data.numpy()) != end - begin:
                raise ValueError(f"{path}: tensor {name!r} is truncated")
            yield name, data.view(_SAFETENSORS_DTYPES[entry["dtype"]]).view(entry["shape"])


@contextlib.contextmanager
def _shard_progress(enabled: bool, total: int) -> Iterator[Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("loading shards"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(
        *columns, console=Console(stderr=True), disable=not enabled, transient=True
    ) as bar:
        task = bar.add_task("shards", total=total)
        yield lambda: bar.update(task, advance=1)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay real.

    ``nn.Module.register_parameter`` is wrapped for the duration (as accelerate's
    ``init_empty_weights(include_buffers=False)`` does): each new parameter is replaced by a
    meta one, so its initialisation (which runs after registration) costs nothing. A
    parameter already on meta is kept as is, so ties (``lm_head.weight = embed.weight``)
    stay ties. ``nn.init.normal_`` leaves a meta tensor alone: on meta it runs torch's
    Python reference, which imports dynamo (1.7 s on a slow machine, for an engine that may
    never compile: hybridkv.ops.compiled), and fills nothing anyway. Both are process-wide
    patches: builds in two threads take turns (a lock), or one could restore the other's
    patch and leave it in place for good.
    """
    with _META_BUILD:  # the originals are read inside: not another build's patches
        register = nn.Module.register_parameter
        normal = nn.init.normal_

        def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            register(module, name, param)

        def normal_unless_meta(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return tensor if tensor.is_meta else normal(tensor, *args, **kwargs)

        nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
        nn.init.normal_ = normal_unless_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]
            nn.init.normal_ = normal


_META_BUILD = threading.RLock()  # parameters_on_meta's patches: one build at a time


def load_model(
    model_dir: str | Path,
    dtype: str = "bfloat16",
    device: str = "cpu",
    *,
    kv_dtype: str | None = None,
    ssm_dtype: str | None = None,
    tokenizer_dir: str | Path | None = None,
    pack_weights: bool | None = False,
    matmul_dtype: str = "auto",
    weight_memory_limit: int | None = None,
) -> LoadedModel:
    """Build the model of ``model_dir`` in ``dtype`` and load its weights.

    ``dtype`` "auto" is resolved by :func:`resolve_dtype` for ``device`` (the model is
    built on the CPU; the caller moves it). Cache dtypes: KV (``kv_dtype``, default the model
    dtype) and conv state in ``dtype``; the SSM state ``ssm_dtype``, default the core's family
    rule, except that an fp32 model keeps everything in fp32. The tokenizer is read from
    ``tokenizer_dir`` if given, else from ``model_dir`` (none there: no tokenizer). On the
    CPU, ``pack_weights`` lays the large linear weights out once for oneDNN
    (:mod:`hybridkv.layers.packed_linear`): faster, inference only; the checkpoint is
    then read into memory rather than mapped (a packed copy made from mapped pages would
    leave them resident beside it), which makes the load slower; None packs where
    :func:`packs_by_default`. ``matmul_dtype`` (one of
    :data:`MATMUL_DTYPES`), on the CPU: "float32" holds a bf16 / fp16 model's matmul
    weights in fp32 and runs its products in fp32 (:mod:`hybridkv.layers.fp32_matmul`;
    the checkpoint is then read unmapped too); "auto" does so where the CPU only emulates
    the model dtype's matmuls (:func:`~hybridkv.ops.cpu_gemm.native_gemm`: AVX2 alone);
    "model" never. ``weight_memory_limit``: the bytes the loaded weights may take (None:
    no limit; the engine's :func:`~hybridkv.engine.startup.weight_memory_limit`): "auto"
    keeps the model dtype where the fp32 copies would pass it (a warning says so), and an
    asked "float32" warns that they may not fit.

    Raises:
        ValueError: unsupported dtype or model type.
        KeyError / FileNotFoundError: the checkpoint is incomplete.
    """
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    dtype = canonical_dtype(resolve_dtype(dtype, device, raw))
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"model dtype must be one of {MODEL_DTYPES}, not {dtype!r}")
    if matmul_dtype not in MATMUL_DTYPES:
        raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, not {matmul_dtype!r}")
    spec = model_spec_from_config(
        raw,
        name=model_dir.name,
        kv_dtype=kv_dtype or dtype,
        conv_dtype=dtype,
        ssm_dtype=ssm_dtype or ("float32" if dtype == "float32" else None),
    )
    cfg = flatten_text_config(raw)
    start = time.perf_counter()
    with parameters_on_meta():
        model = model_class(spec.model_type)(cfg, spec)
    for param in model.parameters():  # meta: free; buffers (RoPE frequencies) stay fp32
        param.data = param.data.to(TORCH_DTYPES[dtype])
    model.materialize_device = torch.device(device)
    files = safetensors_files(model_dir)
    upcasts = _upcasts(matmul_dtype, dtype, device) and _upcast_fits(
        model, matmul_dtype, dtype, weight_memory_limit
    )
    if pack_weights is None:
        pack_weights = packs_by_default(model, dtype, upcasts)
    pack = pack_weights and device == "cpu"
    progress = len(files) > 1 and sys.stderr.isatty()
    # packing and fp32 matmul weights copy the weights: read them unmapped, or the mapped
    # pages stay resident beside the copies while any tensor of the file lives
    model.load_weights(iter_safetensors(files, progress=progress, mapped=not (pack or upcasts)))
    model.to(device)  # the buffers; the parameters are there already
    model.eval()
    upcast = upcast_linears(model) if upcasts else 0
    packed = pack_linears(model) if pack else 0
    by_dtype: dict[torch.dtype, int] = {}
    for param in model.parameters():
        by_dtype[param.dtype] = by_dtype.get(param.dtype, 0) + param.numel() * param.element_size()
    logger.info(
        "loaded %s (%s) in %.1f s: %s of weights from %d shard(s), %d linear(s) packed%s",
        model_dir,
        dtype,
        time.perf_counter() - start,
        ", ".join(f"{n / (1 << 30):.2f} GiB {_name(d)}" for d, n in by_dtype.items()),
        len(files),
        packed,
        f", {upcast} held in float32 for fp32 matmuls" if upcast else "",
    )
    if upcast and matmul_dtype == "auto":
        logger.info(
            "this CPU has no native %s matmul (oneDNN needs AVX-512 or AVX-NE-CONVERT): the "
            "model's matmul weights are held in float32 (twice their memory) and multiplied "
            "in float32; --cpu-matmul-dtype model keeps them in %s",
            dtype,
            dtype,
        )
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
    tokenizer = Tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file() else None
    return LoadedModel(model=model, spec=spec, tokenizer=tokenizer, config=cfg, dtype=dtype)


def _upcast_fits(model: nn.Module, matmul_dtype: str, dtype: str, limit: int | None) -> bool:
    """Whether the loader holds ``model``'s matmul weights in fp32, asked for or chosen by
    "auto": "auto" only where the weights, fp32 copies included, stay within ``limit``
    bytes. Otherwise the model dtype's emulated matmuls are slow, but an fp32 copy that
    does not fit would be worse: the load killed for lack of memory, or the cache left
    without room (a bf16 model of 160 GB becomes 320 GB). An asked "float32" is kept, with
    a warning. ``model`` is built on meta: its parameters give the bytes."""
    if limit is None:
        return True
    weights = parameter_bytes(model)
    extra = upcast_extra_bytes(model)
    if weights + extra <= limit:
        return True
    sizes = (
        f"the {dtype} weights take {weights / GIB:.2f} GiB and their fp32 matmul copies "
        f"{extra / GIB:.2f} GiB more, past the {max(limit, 0) / GIB:.2f} GiB the weights "
        "may take beside the cache"
    )
    if matmul_dtype == "auto":
        logger.warning(
            "this CPU has no native %s matmul, but its matmuls stay in %s (emulated: several "
            "times slower): %s; free memory, give a smaller --cache-memory-gib, or pass "
            "--cpu-matmul-dtype float32 to convert them anyway",
            dtype,
            dtype,
            sizes,
        )
        return False
    logger.warning("--cpu-matmul-dtype float32 converts the matmul weights, but %s", sizes)
    return True


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# the most weight bytes a model packs by default (packs_by_default): packing reads the
# checkpoint into memory and reorders every large weight, 0.10 -> 0.14 s for the 84 MB of
# the small Qwen3-Next of issue 13, 0.8 -> 7.2 s for Qwen3.5-0.8B's 2,659 MiB (~2.4 s a
# GiB: benchmarks/load_memory.py, docs/architecture.md), so ~1.2 s at this limit; larger
# models opt in
AUTO_PACK_MAX_BYTES = 512 << 20


def packs_by_default(model: nn.Module, dtype: str, upcasts: bool) -> bool:
    """Whether ``pack_weights=None`` packs this model: one in bf16 (fp16 has no packing
    threshold: :data:`~hybridkv.layers.packed_linear.MIN_PACKED_ELEMENTS`) that multiplies
    in its own dtype (packed products are then the plain ones' bits; fp32 ones round
    otherwise than MKL's, and transformers' answers are the fp32 reference) with weights
    of at most :data:`AUTO_PACK_MAX_BYTES`. Its small-batch matmuls gain most: the decode
    graph's 8-row step of the small Qwen3-Next 11.1 -> 8.4 ms (its experts' one-to-three-row
    products ~1.6x)."""
    if dtype not in ("bfloat16", "float16") or upcasts:
        return False
    fits = parameter_bytes(model) <= AUTO_PACK_MAX_BYTES
    return fits and packing_threshold(TORCH_DTYPES[dtype]) is not None


def _upcasts(matmul_dtype: str, dtype: str, device: str) -> bool:
    """Whether the loader holds the matmul weights in fp32 (:func:`load_model`): on the
    CPU only (other devices multiply their model dtype natively)."""
    if dtype not in ("bfloat16", "float16") or matmul_dtype == "model" or device != "cpu":
        return False
    return matmul_dtype == "float32" or not native_gemm(TORCH_DTYPES[dtype], device)


__all__ = ["MATMUL_DTYPES", "LoadedModel", "load_model", "resolve_dtype"]
