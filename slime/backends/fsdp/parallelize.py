"""Parallelism for a plain Hugging Face model, one small function per technique, applied in a
fixed order by :func:`parallelize_model`:

1. activation checkpointing (``--gradient-checkpointing``) on every transformer block;
2. FSDP2 (``torch.distributed.fsdp.fully_shard``) on every transformer block: the decoder
   layers of the language model and the blocks of the vision tower, i.e. the classes the
   model lists in ``_no_split_modules``;
3. FSDP2 on the root module, which then holds the remaining parameters (embeddings, final
   norm, LM head, the vision patch embedding, position embedding and merger).

Each block's parameters are gathered just before its forward and freed after it (and again
for its backward), so a rank holds its shard of the model plus about one full block.
Mixed precision (``--bf16`` on GPU): parameters are gathered and computed in bfloat16 and
gradients reduced in float32 onto float32 master shards (``MixedPrecisionPolicy``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in module order: instances of the classes named in its
    ``_no_split_modules`` (for Qwen3.5: ``Qwen3_5MoeDecoderLayer`` and ``Qwen3_5MoeVisionBlock``).

    Raises:
        ValueError: the model names no such classes, or none of its modules is one.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} lists no block classes in _no_split_modules ({sorted(names)}) that occur in it; "
            "the FSDP backend shards a Hugging Face model block by block"
        )
    return blocks


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass instead of storing them.

    Uses transformers' own mechanism (``gradient_checkpointing_enable``, non-reentrant
    ``torch.utils.checkpoint``), which keeps parameter names unchanged (a
    ``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module`` into every name).  It
    composes with FSDP2: the recomputation runs inside the block's backward, where FSDP has
    already gathered its parameters.  Active in ``model.train()`` mode only.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> None:
    """Shard ``model`` over ``mesh`` with FSDP2: every block (:func:`transformer_blocks`), then the root.

    Args:
        model: a plain model (on any device, ``meta`` included).
        mesh: 1-D data-parallel device mesh.
        param_dtype: compute dtype of gathered parameters (bfloat16 for mixed precision, with
            float32 gradient reduction); None computes in the parameters' own dtype.
    """
    if param_dtype is None:
        mp_policy = MixedPrecisionPolicy()
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def parallelize_model(
    model: nn.Module, mesh: DeviceMesh, *, gradient_checkpointing: bool, param_dtype: torch.dtype | None
) -> nn.Module:
    """Apply activation checkpointing (if asked), then FSDP2, in that order; returns ``model`` (modified in place)."""
    if gradient_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, mesh, param_dtype)
    return model
