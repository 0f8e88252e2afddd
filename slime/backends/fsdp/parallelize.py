"""Parallelism for a plain Hugging Face model, applied by :func:`parallelize_model` in this order: activation
checkpointing (``--gradient-checkpointing``) on every transformer block, FSDP2 (``fully_shard``) on every block (the
classes of ``_no_split_modules``: decoder layers, vision blocks), then FSDP2 on the root, which holds the rest.  On
GPU a rank holds its shard plus about one gathered block; on CPU (gloo) the blocks stay gathered from forward to
backward (see :func:`apply_fsdp`; the backend also reduces gradients once per step there).  ``--bf16`` on GPU gathers and computes in bfloat16 and reduces gradients in float32
onto float32 master shards (``MixedPrecisionPolicy``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks in module order: instances of the classes its ``_no_split_modules`` names (Qwen3.5:
    ``Qwen3_5MoeDecoderLayer``, ``Qwen3_5MoeVisionBlock``); ``ValueError`` when there are none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} lists no block classes in _no_split_modules ({sorted(names)}) that occur in it; "
            "the FSDP backend shards a Hugging Face model block by block"
        )
    return blocks


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass with transformers' own mechanism (non-reentrant
    ``torch.utils.checkpoint``, which keeps parameter names, unlike a ``checkpoint_wrapper``); active in train mode."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True
) -> None:
    """Shard ``model`` (any device, ``meta`` included) over the 1-D ``mesh`` with FSDP2: every block, then the root;
    ``param_dtype``: the compute dtype of gathered parameters (float32 gradient reduction), None: their own.

    ``reshard_after_forward`` False keeps each block gathered from its forward to its backward (and across no-grad
    forwards, until :func:`reshard_all`): one all-gather per block and micro-batch instead of two, for holding the
    whole model's parameters gathered.  The values computed are the same either way."""
    if param_dtype is None:
        mp_policy = MixedPrecisionPolicy()
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP unit's gathered parameters and put the sharded ones back in place (``FSDPModule.reshard`` is not
    recursive): after forwards without a backward, before reading the parameters as shards (save, weight sync)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def parallelize_model(
    model: nn.Module, mesh: DeviceMesh, *, gradient_checkpointing: bool, param_dtype: torch.dtype | None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply activation checkpointing (if asked), then FSDP2 (:func:`apply_fsdp`), in that order; returns ``model``
    (modified in place)."""
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, mesh, param_dtype, reshard_after_forward)
    return model
