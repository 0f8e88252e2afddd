"""Hugging Face checkpoints in and out of an FSDP2-sharded model.

In: :func:`load_sharded_model` reads a checkpoint folder on rank 0 only (one CPU copy of
the weights on the node of rank 0, not one per rank), builds the model on the ``meta``
device on every rank, shards it (:mod:`slime.backends.fsdp.parallelize`) and broadcasts the
weights from rank 0 into the shards.

Out: :func:`iter_hf_weight_groups` (saving, everything on rank 0) and
:func:`iter_hf_weight_buckets` (weight sync, each bucket on its source rank) gather the full
weights one FSDP unit (one decoder layer, one vision block, then the root's remaining
parameters) at a time and rename them to the checkpoint's names: transformers 5 keeps MoE experts fused in memory
(``mlp.experts.gate_up_proj [E, 2I, H]``) while checkpoints (and SGLang's loader) hold one
tensor per expert (``mlp.experts.{e}.gate_proj.weight``); the in-memory -> checkpoint
conversion is ``transformers.core_model_loading.revert_weight_conversion``, the function
``save_pretrained`` uses.  :func:`save_hf_folder` writes those groups as a sharded
safetensors folder next to the source checkpoint's config, tokenizer and processor files.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

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

from slime.backends.fsdp.parallelize import parallelize_model
from slime.weight_sync.buckets import bucket_by_bytes, weight_rounds

WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth")
"""Files of a checkpoint folder that hold weights; every other top-level file is copied on save."""

SAFETENSORS_INDEX = "model.safetensors.index.json"

WeightGroup = list[tuple[str, torch.Tensor]]


def model_class(config: transformers.PretrainedConfig) -> type[transformers.PreTrainedModel]:
    """The transformers class named by ``config.architectures[0]`` (e.g. ``Qwen3_5MoeForConditionalGeneration``).

    Raises:
        ValueError: the config names no architecture, or transformers has no such class.
    """
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
    """Build the FSDP2-sharded model of the checkpoint folder ``path``. Collective.

    Rank 0 loads the checkpoint with ``from_pretrained`` on CPU; every rank builds the same
    model on ``meta``, applies :func:`~slime.backends.fsdp.parallelize.parallelize_model`,
    allocates its shards on ``device`` and receives them from rank 0
    (``set_model_state_dict(broadcast_from_rank0=True)``).  Buffers that are not in the
    state dict (rotary ``inv_freq``) are broadcast from rank 0's loaded model too.

    Args:
        path: Hugging Face checkpoint folder.
        mesh: 1-D data-parallel mesh.
        device: where the shards live (``cuda:<local rank>`` or ``cpu``).
        dtype: dtype of the stored shards (float32 master weights for the policy; the
            compute dtype for a frozen reference model).
        attn_implementation: transformers attention kernel (``--attn-implementation``).
        gradient_checkpointing: recompute block activations in backward.
        param_dtype: mixed-precision compute dtype (bfloat16) or None.
        trainable: False freezes every parameter (reference model).

    Returns:
        The sharded model (a ``FSDPModule``), in train mode when ``trainable`` else eval mode.

    Raises:
        ValueError: see :func:`model_class`; also for a model with tied input/output embeddings
            (not supported).  (The folder itself is checked by
            :func:`slime.backends.weight_sources.resolve_weights`.)
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
    parallelize_model(model, mesh, gradient_checkpointing=gradient_checkpointing and trainable, param_dtype=param_dtype)
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
    """The model's state-dict names grouped by owning FSDP unit: every unit below the root (one
    decoder layer / vision block each), in module order, then the root's own parameters; empty
    groups are left out.  The same on every rank."""
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
    """Full weights by checkpoint name, one FSDP unit at a time, all on rank 0 (for saving).

    Collective: every rank must exhaust the iterator (each group is all-gathered), but only
    rank 0 (or the only process, without ``torch.distributed``) yields the groups; on the
    other ranks the iterator is empty.  Groups come in :func:`fsdp_unit_groups` order; each is
    converted to checkpoint names with ``revert_weight_conversion`` (fused experts -> one
    tensor per expert, per layer, so a group holds whole layers); vision-tower names pass
    through unchanged.

    Args:
        model: the sharded model (plain tensors are passed through as they are).
        dtype: dtype of the yielded tensors (the float32 master dtype for checkpoints).
        device: where the yielded tensors live.

    Yields:
        On rank 0: lists of ``(checkpoint name, contiguous tensor)``.
    """
    if isinstance(model, FSDPModule):
        model.reshard()  # a root gathered by a forward without backward would expose unsharded (compute-dtype) tensors
    receiver = not dist.is_initialized() or dist.get_rank() == 0
    state = model.state_dict()
    for names in fsdp_unit_groups(model):
        full = _gather(state, names)
        if receiver:
            yield _checkpoint_group(model, full, dtype, device)


def iter_hf_weight_buckets(
    model: nn.Module, dtype: torch.dtype, bucket_bytes: int, device: torch.device | str = "cpu"
) -> Iterator[WeightGroup]:
    """This rank's share of the full weights by checkpoint name, in lockstep buckets (for the weight sync).

    The FSDP units (:func:`fsdp_unit_groups`) are packed into rounds of about ``bucket_bytes``
    (:func:`slime.weight_sync.buckets.weight_rounds`, sizes from the global shapes in ``dtype``, so every
    rank computes the same rounds); round ``k`` is sourced by rank ``k % world_size``.  Every rank takes part in
    every gather (``DTensor.full_tensor`` is an all-gather) and yields once per round: the source
    rank its converted tensors (as :func:`iter_hf_weight_groups` converts them), every other rank
    ``[]``.  So the union over ranks holds each checkpoint name once, every rank is a source when
    there are at least ``world_size`` rounds, and transports may run collectives between buckets.

    Args:
        model: the sharded model.
        dtype: dtype of the yielded tensors (the compute dtype for the weight sync).
        bucket_bytes: target bucket size, bytes, > 0.
        device: where the yielded tensors live.

    Yields:
        One bucket per round: ``[(checkpoint name, contiguous tensor), ...]`` on its source rank, else ``[]``.

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """
    if isinstance(model, FSDPModule):
        model.reshard()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    state = model.state_dict()
    groups = fsdp_unit_groups(model)
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
    """Copy every top-level file of checkpoint folder ``source`` that holds no weights
    (config, generation config, tokenizer, chat template, processor configs) into ``dest``.

    Returns:
        The copied file names, sorted.
    """
    copied = []
    for entry in sorted(Path(source).iterdir()):
        if entry.is_file() and not any(fnmatch.fnmatch(entry.name, pattern) for pattern in WEIGHT_FILE_PATTERNS):
            shutil.copy2(entry, Path(dest) / entry.name)
            copied.append(entry.name)
    return copied


def save_hf_folder(
    groups: Iterable[WeightGroup], out_dir: str | os.PathLike, source: str | os.PathLike, max_shard_bytes: int
) -> None:
    """Write a complete Hugging Face folder: the non-weight files of ``source`` and ``groups`` as safetensors.

    The weights go to ``model-XXXXX-of-YYYYY.safetensors`` shards of about
    ``max_shard_bytes`` (a group is never split across shards) with the standard
    ``model.safetensors.index.json``, so ``from_pretrained(out_dir)`` loads the folder and
    SGLang reads it as a checkpoint.  ``config.json`` is copied unchanged (training does not
    change the architecture; fields only engines read are kept).

    Args:
        groups: ``(checkpoint name, tensor)`` groups, e.g. from :func:`iter_hf_weight_groups`.
        out_dir: destination folder (created; stale weight files in it are removed first).
        source: the checkpoint folder the run started from (``--hf-checkpoint``).
        max_shard_bytes: target size of one safetensors file, bytes.
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
