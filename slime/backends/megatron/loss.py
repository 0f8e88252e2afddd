"""The Megatron backend's forward step and loss functions, in megatron-core's ``forward_step_func`` contract.

The schedule calls ``forward_step_func(data_iterator, model) -> (output, loss_func)`` per micro-batch and, on the last
stage, ``loss_func(output)``; ``output`` is this TP rank's vocabulary columns of the logits at the response-predicting
positions, ``[K, 1, Vp / tp]``.  Both loss functions take log-probs (and entropies) under ``softmax(logits / T)`` with
:func:`slime.grpo.log_probs.vocab_parallel_log_probs` (TP vocabulary padding left out).  :func:`grpo_loss_func`
returns ``(loss * num_microbatches * dp, 1, metrics)``: the schedule divides by the token count (1) and the
micro-batches, DDP averages over ``dp`` ranks, so the summed gradient is that of the step's mean loss
(``docs/design/grpo.md``).  :func:`log_prob_func` returns the detached log-probs (forward-only passes).
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
from slime.grpo.token_advantages import Whitening


@dataclasses.dataclass(frozen=True)
class LossContext:
    """What the loss functions need besides the micro-batch: ``temperature``, the real ``vocab_size`` (the checkpoint's,
    TP padding excluded), the vocab-parallel ``tp_group``, the ``device`` micro-batches move to, and for training
    ``grpo``, the step's ``normalizer`` over all DP ranks (:func:`slime.backends.steps.loss_normalizer`), this rank's
    ``num_microbatches`` and ``dp_size``, and the rollout's ``whitening`` (``--normalize-advantages``)."""

    temperature: float
    vocab_size: int
    tp_group: object
    device: torch.device = torch.device("cpu")
    grpo: GRPOConfig | None = None
    normalizer: float | None = None
    num_microbatches: int = 1
    dp_size: int = 1
    whitening: Whitening | None = None


def _log_probs(ctx: LossContext, batch: PackedBatch, logits: Tensor, with_entropy: bool):
    return vocab_parallel_log_probs(logits[:, 0], batch.targets, ctx.temperature, ctx.tp_group,
                                    vocab_size=ctx.vocab_size, with_entropy=with_entropy)


def grpo_loss_func(ctx: LossContext, batch: PackedBatch, logits: Tensor):
    """megatron-core loss function of one training micro-batch (module docstring): ``(scaled loss, ones(int),
    metrics)``, the metrics this micro-batch's detached 0-d shares of ``loss``, ``pg_loss``, ``pg_clipfrac``,
    ``ppo_kl``, ``entropy`` (and ``kl_loss``, and the IS / OPSM metrics of :func:`grpo_micro_batch_loss`)."""
    log_probs, entropy = _log_probs(ctx, batch, logits, with_entropy=True)
    if ctx.grpo.entropy_coef == 0:
        entropy = entropy.detach()  # a metric only: spare its backward
    loss, metrics = grpo_micro_batch_loss(
        log_probs, batch.old_log_probs, batch.advantages, batch.loss_mask, ctx.grpo,
        global_normalizer=ctx.normalizer, ref_log_probs=batch.ref_log_probs,
        rollout_log_probs=batch.rollout_log_probs, entropy=entropy,
        cu_seqlens=batch.cu_seqlens, advantage_whitening=ctx.whitening,
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
