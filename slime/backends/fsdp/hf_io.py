"""Hugging Face checkpoints in and out of an FSDP2-sharded model.

In: :func:`load_sharded_model` reads the folder on rank 0 only, builds the model on ``meta`` on every rank, shards it
and broadcasts the weights into the shards.  Out: :func:`iter_hf_weight_groups` (saving, on rank 0) and
:func:`iter_hf_weight_buckets` (weight sync, on each bucket's source rank) gather the full weights one FSDP unit at a
time and rename them to checkpoint names with ``transformers.core_model_loading.revert_weight_conversion`` (fused
in-memory experts -> one tensor per expert, as checkpoints and SGLang's loader hold them); :func:`save_hf_folder`
writes them as sharded safetensors next to the source's config, tokenizer and processor files.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path
from typing import Collection, Iterable, Iterator

import torch
import torch.distributed as dist
import transformers
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion

from slime.backends.fsdp.parallelize import parallelize_model, reshard_all
from slime.weight_sync.buckets import bucket_by_bytes, weight_rounds

WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")
"""Files of a checkpoint folder that hold weights; every other top-level file is copied on save."""

SAFETENSORS_INDEX = "model.safetensors.index.json"

WeightGroup = list[tuple[str, torch.Tensor]]


def model_class(config: transformers.PretrainedConfig) -> type[transformers.PreTrainedModel]:
    """The transformers class ``config.architectures[0]`` names (e.g. ``Qwen3_5MoeForConditionalGeneration``);
    ``ValueError`` when it names none, or transformers has no such class."""
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        raise ValueError(
            f"config.json architectures = {archs!r} names no transformers model class; "
            "the FSDP backend needs e.g. ['Qwen3_5MoeForConditionalGeneration']"
        )
    return cls


def load_sharded_model(
    path: str | os.PathLike,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    dtype: torch.dtype,
    attn_implementation: str,
    gradient_checkpointing: bool = False,
    param_dtype: torch.dtype | None = None,
    trainable: bool = True,
) -> nn.Module:
    """Build the FSDP2-sharded model of checkpoint folder ``path``. Collective.

    Rank 0 loads it with ``from_pretrained`` on CPU; every rank builds it on ``meta``, parallelises it
    (:func:`~slime.backends.fsdp.parallelize.parallelize_model`), allocates its shards on ``device`` and receives them
    from rank 0 (``set_model_state_dict(broadcast_from_rank0=True)``), buffers outside the state dict (rotary
    ``inv_freq``) too.  ``dtype``: of the stored shards (float32 master weights; the compute dtype for a frozen
    reference); ``param_dtype``: the mixed-precision compute dtype or None; ``trainable`` False freezes every parameter.

    Returns:
        The sharded model (an ``FSDPModule``), in train mode when ``trainable``, else in eval mode.

    Raises:
        ValueError: see :func:`model_class`; tied input/output embeddings (not supported).
    """
    config = transformers.AutoConfig.from_pretrained(path)
    cls = model_class(config)
    full_state: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0:
        loaded = cls.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
        full_state = loaded.state_dict()
        buffers = {name: buf.detach().clone() for name, buf in loaded.named_buffers()}
        del loaded
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    output = model.get_output_embeddings()
    if output is not None and output.weight is model.get_input_embeddings().weight:
        raise ValueError(
            f"{path}: tied input/output embeddings (tie_word_embeddings) are not supported by the FSDP backend"
        )
    model.requires_grad_(trainable)
    # On CPU (gloo, the tiny test models) a second all-gather per block and micro-batch costs far more than holding
    # the gathered model; on GPU the blocks are resharded after each forward to keep the memory of one block.
    parallelize_model(model, mesh, gradient_checkpointing=gradient_checkpointing and trainable, param_dtype=param_dtype,
                      reshard_after_forward=torch.device(device).type != "cpu")
    model.to_empty(device=device)
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if dist.get_rank() == 0:
                buf.copy_(buffers[name])
            dist.broadcast(buf, src=0)
    return model.train(trainable)


def fsdp_unit_prefixes(model: nn.Module) -> list[str]:
    """Qualified names of the FSDP units below the root (decoder layers, vision blocks), in module order."""
    return [name for name, module in model.named_modules() if name and isinstance(module, FSDPModule)]


def fsdp_unit_groups(model: nn.Module) -> list[list[str]]:
    """State-dict names grouped by owning FSDP unit (each unit below the root in module order, then the root's own),
    empty groups left out; the same on every rank."""
    units = fsdp_unit_prefixes(model)
    groups: dict[str, list[str]] = {unit: [] for unit in units}
    groups[""] = []
    for name in model.state_dict():
        owner = max((u for u in units if name.startswith(u + ".")), key=len, default="")
        groups[owner].append(name)
    return [names for names in groups.values() if names]


def _gather(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """The full tensors of ``names`` (collective: every rank all-gathers each ``DTensor``)."""
    full = {}
    for name in names:
        tensor = state[name]
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        full[name] = tensor.detach()
    return full


def _checkpoint_group(
    model: nn.Module, full: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str
) -> WeightGroup:
    """In-memory names -> checkpoint names (``revert_weight_conversion``), tensors cast and made contiguous."""
    converted = revert_weight_conversion(model, full)
    return [(name, t.to(device=device, dtype=dtype).contiguous()) for name, t in converted.items()]


def iter_hf_weight_groups(
    model: nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Iterator[WeightGroup]:
    """Full weights by checkpoint name, one FSDP unit (whole layers) at a time in :func:`fsdp_unit_groups` order, as
    lists of ``(name, contiguous tensor)`` in ``dtype`` on ``device``, for saving.  Collective: every rank exhausts the
    iterator (each group is all-gathered), but only rank 0 (or a lone process) yields."""
    reshard_all(model)  # units gathered by a forward without backward would expose unsharded (compute-dtype) tensors
    receiver = not dist.is_initialized() or dist.get_rank() == 0
    state = model.state_dict()
    for names in fsdp_unit_groups(model):
        full = _gather(state, names)
        if receiver:
            yield _checkpoint_group(model, full, dtype, device)


def iter_hf_weight_buckets(
    model: nn.Module, dtype: torch.dtype, bucket_bytes: int, device: torch.device | str = "cpu",
    skip: Collection[str] = frozenset(),
) -> Iterator[WeightGroup]:
    """This rank's share of the full weights by checkpoint name, in lockstep buckets for the weight sync: the FSDP units
    packed into rounds of about ``bucket_bytes`` (:func:`slime.weight_sync.buckets.weight_rounds`, sizes from the global
    shapes in ``dtype``, the same on every rank), round ``k`` yielded by rank ``k % world_size`` (converted as
    :func:`iter_hf_weight_groups` does) and ``[]`` by the others.  Every rank takes part in every gather.  The
    state-dict names in ``skip`` (the same on every rank) are left out, gathers included.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    reshard_all(model)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    state = model.state_dict()
    groups = [kept for kept in ([n for n in names if n not in skip] for names in fsdp_unit_groups(model)) if kept]
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [sum(state[name].numel() * itemsize for name in names) for names in groups]
    for k, members in enumerate(weight_rounds(sizes, bucket_bytes)):
        bucket: WeightGroup = []
        for index in members:
            full = _gather(state, groups[index])
            if k % world == rank:
                bucket += _checkpoint_group(model, full, dtype, device)
        yield bucket


def copy_side_files(source: str | os.PathLike, dest: str | os.PathLike) -> list[str]:
    """Copy every top-level file of checkpoint folder ``source`` that holds no weights (config, tokenizer, chat
    template, processor files) into ``dest``; returns the copied names, sorted."""
    copied = []
    for entry in sorted(Path(source).iterdir()):
        if entry.is_file() and not any(fnmatch.fnmatch(entry.name, pattern) for pattern in WEIGHT_FILE_PATTERNS):
            shutil.copy2(entry, Path(dest) / entry.name)
            copied.append(entry.name)
    return copied


def save_hf_folder(
    groups: Iterable[WeightGroup], out_dir: str | os.PathLike, source: str | os.PathLike, max_shard_bytes: int
) -> None:
    """Write a complete Hugging Face folder ``out_dir``: ``source``'s non-weight files (``config.json`` unchanged) and
    ``groups`` as ``model-XXXXX-of-YYYYY.safetensors`` shards of about ``max_shard_bytes`` (a group never split) with
    ``model.safetensors.index.json``, loadable by ``from_pretrained`` and SGLang; stale weight files are removed first.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for entry in out.iterdir():
        if any(fnmatch.fnmatch(entry.name, pattern) for pattern in WEIGHT_FILE_PATTERNS):
            entry.unlink()
    copy_side_files(source, out)
    shard_names, weight_map, total_bytes = [], {}, 0
    for index, shard in enumerate(bucket_by_bytes(groups, max_shard_bytes)):
        tmp_name = f"model-{index + 1:05d}.tmp.safetensors"
        save_file(dict(shard), out / tmp_name, metadata={"format": "pt"})
        shard_names.append(tmp_name)
        for name, tensor in shard:
            weight_map[name] = tmp_name
            total_bytes += tensor.numel() * tensor.element_size()
    final_names = {tmp: f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors" for i, tmp in enumerate(shard_names)}
    for tmp, final in final_names.items():
        os.replace(out / tmp, out / final)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {name: final_names[tmp] for name, tmp in sorted(weight_map.items())},
    }
    (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
