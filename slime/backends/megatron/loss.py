"""The Megatron backend's forward step and loss functions, in megatron-core's ``forward_step_func`` contract.

megatron-core's schedule calls ``forward_step_func(data_iterator, model) -> (output, loss_func)`` per
micro-batch and, on the last pipeline stage, ``loss_func(output)``.  Here ``output`` is the model's
logits at the micro-batch's response-predicting positions, this TP rank's vocabulary columns
``[K, 1, Vp / tp]``; both loss functions turn them into per-token log-probs (and entropies) of the
sampled tokens under ``softmax(logits / --rollout-temperature)``, as the engines sample, with
:func:`slime.grpo.log_probs.vocab_parallel_log_probs` (no full-vocabulary tensor; the TP
vocabulary padding is left out of the softmax).

- :func:`grpo_loss_func`: the shared GRPO loss (:func:`slime.grpo.loss.grpo_micro_batch_loss`)
  with the step's global normaliser, returned as megatron-core's 3-tuple ``(loss * num_microbatches *
  dp, 1, metrics)``: the schedule divides by the token count (1) and by ``num_microbatches``, DDP
  averages gradients over the ``dp`` data-parallel ranks, so the gradient summed over micro-batches
  and ranks is that of the step's global mean loss (the contract spelled out in
  ``grpo_micro_batch_loss``'s docstring).
- :func:`log_prob_func`: no loss, the detached log-probs in the metrics slot (forward-only passes:
  old, reference and parity log-probs).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from torch import Tensor

from slime.backends.megatron.batches import PackedBatch
from slime.grpo.config import GRPOConfig
from slime.grpo.log_probs import vocab_parallel_log_probs
from slime.grpo.loss import grpo_micro_batch_loss


@dataclasses.dataclass(frozen=True)
class LossContext:
    """What the loss functions need besides the micro-batch.

    Attributes:
        temperature: ``--rollout-temperature`` (> 0).
        vocab_size: the real vocabulary (the checkpoint's ``vocab_size``; TP padding columns excluded).
        tp_group: the tensor-parallel group of the vocab-parallel log-probs.
        grpo: the GRPO flags.
        normalizer: the optimizer step's sample (or token) count over all DP ranks
            (:func:`slime.backends.steps.loss_normalizer`).
        num_microbatches: micro-batches of this step on this rank.
        dp_size: data-parallel ranks (megatron-core's DDP averages gradients over them).
        device: where micro-batches are moved before their forward pass.
    """

    temperature: float
    vocab_size: int
    tp_group: object
    device: torch.device = torch.device("cpu")
    grpo: GRPOConfig | None = None
    normalizer: float | None = None
    num_microbatches: int = 1
    dp_size: int = 1


def _log_probs(ctx: LossContext, batch: PackedBatch, logits: Tensor, with_entropy: bool):
    return vocab_parallel_log_probs(logits[:, 0], batch.targets, ctx.temperature, ctx.tp_group,
                                    vocab_size=ctx.vocab_size, with_entropy=with_entropy)


def grpo_loss_func(ctx: LossContext, batch: PackedBatch, logits: Tensor):
    """megatron-core loss function of one training micro-batch (module docstring).

    Returns:
        ``(scaled loss, ones(int), metrics)``: metrics are this micro-batch's share of the step's
        ``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, ``entropy`` (and ``kl_loss``), detached 0-d
        tensors that sum over micro-batches and data-parallel ranks to the step's values.
    """
    log_probs, entropy = _log_probs(ctx, batch, logits, with_entropy=True)
    if ctx.grpo.entropy_coef == 0:
        entropy = entropy.detach()  # a metric only: spare its backward
    loss, metrics = grpo_micro_batch_loss(
        log_probs, batch.old_log_probs, batch.advantages, batch.loss_mask, ctx.grpo,
        global_normalizer=ctx.normalizer, ref_log_probs=batch.ref_log_probs, entropy=entropy,
        cu_seqlens=batch.cu_seqlens,
    )
    scale = ctx.num_microbatches * ctx.dp_size
    one = torch.ones((), dtype=torch.int, device=loss.device)
    return loss * scale, one, {"loss": loss.detach(), **metrics}


def log_prob_func(ctx: LossContext, batch: PackedBatch, logits: Tensor):
    """megatron-core loss function of a forward-only pass: ``(0, ones(int), {"log_probs": [K] float32})``."""
    log_probs, _ = _log_probs(ctx, batch, logits, with_entropy=False)
    zero = log_probs.new_zeros(())
    return zero, torch.ones((), dtype=torch.int, device=zero.device), {"log_probs": log_probs.detach()}


def make_forward_step(ctx: LossContext, loss_func):
    """megatron-core's ``forward_step_func`` over an iterator of :class:`PackedBatch` es (moved to
    ``ctx.device`` one at a time), with ``loss_func`` (:func:`grpo_loss_func` or :func:`log_prob_func`)
    bound to ``ctx`` and the micro-batch."""

    def forward_step(data_iterator, model):
        batch = next(data_iterator).to(ctx.device)
        return model(batch.inputs), partial(loss_func, ctx, batch)

    return forward_step
