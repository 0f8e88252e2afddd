"""Megatron's micro-batches: samples -> one packed (THD) micro-batch of the native Qwen3.5 model with the per-token
tensors of the loss, and megatron-core's forward-backward schedule over them with its forward step and loss functions.

A micro-batch of ``S`` samples is one token axis (:class:`slime.models.qwen3_5.model.Qwen35Inputs`): each sample's
prompt and response ids end to end, ``cu_seqlens`` at the boundaries, MRoPE positions restarting per sample, images in
sample order; under sequence parallelism one padding document brings the total to a multiple of TP.  Sample ``s`` at
offset ``o_s`` has its response predicted at ``o_s + P_s - 1 .. o_s + P_s + R_s - 2``; those ``K = sum R_s``
positions are the model's ``logit_index``, and every per-token loss tensor is ``[K]`` on them, with response
boundaries ``cu_seqlens`` ``[S + 1]`` (the layout of :func:`slime.grpo.loss.grpo_micro_batch_loss`).

The schedule calls ``forward_step_func(data_iterator, model) -> (output, loss_func)`` per micro-batch and, on the last
stage, ``loss_func(output)``; ``output`` is this TP rank's vocabulary columns of the logits at those positions,
``[K, 1, Vp / tp]``.  Both loss functions take log-probs (and entropies) under ``softmax(logits / T)``
(:func:`slime.grpo.log_probs.vocab_parallel_log_probs`, TP vocabulary padding left out).  :func:`grpo_loss_func`
returns ``(loss * num_microbatches * dp, 1, metrics)``: the schedule divides by the token count (1) and the
micro-batches, DDP averages over ``dp`` ranks, so the summed gradient is that of the step's mean loss
(``docs/design/grpo.md``).  :func:`run_micro_batches` is ``get_forward_backward_func()`` on CUDA, ending with
``finalize_model_grads``; on CPU, where its schedules cannot run, the same loop of its ``forward_step`` /
``backward_step`` and ``finalize_model_grads`` (``docs/design/training_step.md``).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from slime.backends.samples import check_image_inputs, response_input_ids
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig
from slime.grpo.log_probs import vocab_parallel_log_probs
from slime.grpo.loss import grpo_micro_batch_loss
from slime.grpo.token_advantages import Whitening
from slime.models.qwen3_5.config import Qwen35Arch
from slime.models.qwen3_5.model import Qwen35Document, Qwen35Inputs
from slime.routing_replay import RouteShape, sample_routes, token_routes


@dataclasses.dataclass
class PackedBatch:
    """One packed micro-batch and its loss tensors (module docstring): ``indices`` of its samples in the planned list,
    ``inputs`` (``logit_index`` set), int64 ``targets`` ``[K]``, float32 ``loss_mask`` ``[K]``, int64 ``cu_seqlens``
    ``[S + 1]``, float32 ``advantages`` ``[S]``, ``response_lengths`` (``R_s``), and float32 ``old_log_probs`` /
    ``ref_log_probs`` / ``rollout_log_probs`` ``[K]``, filled before the update."""

    indices: list[int]
    inputs: Qwen35Inputs
    targets: Tensor
    loss_mask: Tensor
    cu_seqlens: Tensor
    advantages: Tensor
    response_lengths: list[int]
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    rollout_log_probs: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed axis (padding included)."""
        return self.inputs.input_ids.numel()

    def to(self, device: torch.device) -> "PackedBatch":
        """The same micro-batch with every tensor on ``device`` (micro-batches wait on the CPU until run)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return dataclasses.replace(
            self, inputs=self.inputs.to(device), targets=move(self.targets), loss_mask=move(self.loss_mask),
            cu_seqlens=move(self.cu_seqlens), advantages=move(self.advantages),
            old_log_probs=move(self.old_log_probs), ref_log_probs=move(self.ref_log_probs),
            rollout_log_probs=move(self.rollout_log_probs),
        )

    def split(self, per_token: Tensor) -> list[Tensor]:
        """A ``[K]`` tensor as one ``[R_s]`` tensor per sample."""
        return list(per_token.split(self.response_lengths))


def pack_micro_batch(
    samples: Sequence[Sample], indices: Sequence[int], arch: Qwen35Arch, device: torch.device,
    *, pad_to_multiple_of: int = 1,
) -> PackedBatch:
    """Pack checked ``samples`` (``indices``: their indices in the caller's list) into one micro-batch on ``device``
    (``arch``: placeholder ids, merge size), its total tokens a multiple of ``pad_to_multiple_of``.

    Raises:
        ValueError: a sample with ``pixel_values`` but no ``image_grid_thw``, or the reverse (naming it).
        slime.models.qwen3_5.rope.PositionError: a prompt's image placeholders and grids disagree.
    """
    placeholders = {arch.image_token_id, arch.video_token_id} - {None}
    documents, logit_index, offset = [], [], 0
    for sample in samples:
        check_image_inputs(sample)
        mm = sample.multimodal_inputs
        ids = list(sample.prompt_token_ids) + response_input_ids(sample, placeholders)
        documents.append(Qwen35Document(
            torch.tensor(ids, dtype=torch.int64), mm.get("pixel_values"),
            None if mm.get("image_grid_thw") is None else torch.as_tensor(mm["image_grid_thw"], dtype=torch.int64),
        ))
        start = offset + len(sample.prompt_token_ids) - 1
        logit_index.extend(range(start, start + sample.response_length))
        offset += len(ids)
    inputs = Qwen35Inputs.pack(documents, arch, pad_to_multiple_of=pad_to_multiple_of)
    if inputs.pixel_values is not None:
        inputs.pixel_values = inputs.pixel_values.float()
    lengths = [s.response_length for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    inputs.logit_index = torch.tensor(logit_index, dtype=torch.int64)
    return PackedBatch(
        indices=list(indices),
        inputs=inputs.to(device),
        targets=torch.tensor([t for s in samples for t in s.response_token_ids], dtype=torch.int64, device=device),
        loss_mask=torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32, device=device),
        cu_seqlens=cu.to(device),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device),
        response_lengths=lengths,
    )


def with_routes(batch: PackedBatch, routes: Sequence[np.ndarray], shape: RouteShape) -> PackedBatch:
    """``batch`` with its samples' routed experts (``routes``, uint8 ``[P + R - 1, layers, top_k]`` per sample) on
    its token axis (:func:`slime.routing_replay.token_routes`: from each sample's first token; the model's own choice
    at its last token and on the padding)."""
    starts = batch.inputs.cu_seqlens[: len(routes)].tolist()
    token_axis = token_routes(routes, starts, batch.num_tokens, shape)
    device = batch.inputs.input_ids.device
    inputs = dataclasses.replace(batch.inputs, routed_experts=torch.from_numpy(token_axis).to(device))
    return dataclasses.replace(batch, inputs=inputs)


def split_routes(batch: PackedBatch, token_axis: np.ndarray, shape: RouteShape) -> list[np.ndarray]:
    """The inverse of :func:`with_routes`: per sample uint8 ``[P + R - 1, layers, top_k]`` from ``token_axis``
    ``[T, layers, top_k]`` (:func:`slime.routing_replay.sample_routes`)."""
    bounds = batch.inputs.cu_seqlens.tolist()
    starts = bounds[: len(batch.response_lengths)]
    lengths = [end - start - 1 for start, end in zip(starts, bounds[1:])]
    return sample_routes(token_axis, starts, lengths, shape)


def packed_per_token(rows: Sequence[Tensor], device: torch.device) -> Tensor:
    """Per-sample ``[R_s]`` tensors concatenated into the packed ``[K]`` layout (float32)."""
    return torch.cat([torch.as_tensor(r, dtype=torch.float32) for r in rows]).to(device)


@dataclasses.dataclass(frozen=True)
class LossContext:
    """What the loss functions need besides the micro-batch: ``temperature``, the real ``vocab_size`` (the checkpoint's,
    TP padding excluded), the vocab-parallel ``tp_group``, the ``device`` micro-batches move to, and for training
    ``grpo``, the step's ``normalizer`` over all DP ranks (:func:`slime.backends.step.loss_normalizer`), this rank's
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
    ``ppo_kl``, ``entropy`` (and ``kl_loss``, and the IS / OPSM / mismatch metrics of
    :func:`grpo_micro_batch_loss`)."""
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


def run_micro_batches(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch],
    forward_step_func: Callable,
    *,
    forward_only: bool,
    device: torch.device,
) -> list[dict]:
    """Forward (and unless ``forward_only``, backward and gradient finalisation) every micro-batch of one optimizer
    step, in order (the same count on every DP rank).  ``model`` as the schedule sees it (DDP wrapper, CPU stand-in, or
    the bare model for forward-only passes); ``forward_step_func`` from :func:`.loss.make_forward_step`.  Returns the
    loss functions' metrics, one dict per micro-batch, on the last pipeline stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if device.type == "cuda":
        forward_backward = get_forward_backward_func()
        return forward_backward(
            forward_step_func=forward_step_func, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=max(b.num_tokens for b in batches), micro_batch_size=1,
            forward_only=forward_only,
        )
    return _cpu_no_pipelining(model, batches, forward_step_func, forward_only=forward_only)


def _cpu_no_pipelining(model, batches, forward_step_func, *, forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.utils import get_model_config, get_model_type

    config = get_model_config(model)
    model_type = get_model_type(model)
    store: list[dict] = []
    iterator = iter(batches)
    for i in range(len(batches)):
        output, _ = forward_step(forward_step_func, iterator, model, len(batches), None, store, config,
                                 cp_group_size=1, is_first_microbatch=i == 0, current_microbatch=i)
        if not forward_only:
            backward_step(None, output, None, model_type, config)
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], None)
    return store
