"""``--train-backend megatron``: GRPO on the native Megatron Qwen3.5 model (:mod:`slime.models.qwen3_5`).

One :class:`MegatronBackend` per rank.  ``init`` builds megatron-core's parallel state (:mod:`.parallel`), this rank's
pipeline stage (:mod:`.model`), DDP and AdamW (:mod:`.optimizer`) and, with a KL term, a reference model.  It is the
training step's backend (:class:`slime.backends.step.StepBackend`): packed THD micro-batches through megatron-core's
forward-backward schedule with the shared GRPO loss over vocab-parallel log-probs (below).  Weights leave by Hugging
Face name (:mod:`.weight_export`); checkpoints: :mod:`.checkpoint`.  Precision: ``--bf16`` on GPU trains bf16
parameters with fp32 main weights and moments (``A_log`` stays fp32); on CPU everything is fp32 and only data
parallelism runs; log-probs and losses are fp32.

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
import logging
from functools import partial
from pathlib import Path
from typing import Callable, ClassVar, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.config import RankInfo, TrainerSpec
from slime.backends.freeze import freeze_policy
from slime.backends.handover import WEIGHTS, HandOver
from slime.backends.megatron import checkpoint as mckpt
from slime.backends.megatron.config import MegatronConfig
from slime.backends.megatron.model import build_stage
from slime.backends.megatron.parallel import Groups, init_model_parallel, init_world
from slime.backends.megatron.weight_export import iter_buckets
from slime.backends.samples import model_input_ids
from slime.backends.step import FORWARD_LOG_PROBS, MicroBatch, compute_log_probs
from slime.backends.train_metrics import DataParallel
from slime.backends.weight_sources import WeightSource, resolve_weights
from slime.checkpoints import layout as ckpt
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig
from slime.grpo.log_probs import vocab_parallel_log_probs
from slime.grpo.loss import grpo_micro_batch_loss
from slime.grpo.token_advantages import Whitening
from slime.models.qwen3_5.config import Qwen35Arch
from slime.models.qwen3_5.model import Qwen35Document, Qwen35Inputs, to_device
from slime.routing_replay import RouteError, RouteShape, packed_routes
from slime.utils.timer import MicroBatchClock, micro_batch_metrics

logger = logging.getLogger(__name__)


class MegatronBackend:
    """One rank of the Megatron trainer (module docstring); every public method is collective.  ``spec``: the flag
    groups every rank gets; ``config``: its BACKEND_ARGS.

    Attributes (besides :class:`~slime.backends.step.StepBackend`'s, set by :meth:`init`):
        frozen: this rank's frozen policy parameters, by native name (``--freeze-params-name-list``).
        frozen_hf_names: the checkpoint names of every frozen tensor over all ranks (the weight sync sends them once).
    """

    flag_group: ClassVar[str] = "megatron"
    """Its own flag group in the run's config (:meth:`slime.arguments.SlimeConfig.backend_config`)."""

    def __init__(self, rank_info: RankInfo, spec: TrainerSpec, config: MegatronConfig):
        self.rank_info, self.spec, self.megatron = rank_info, spec, config
        self.dtype = torch.float32
        self.groups: Groups | None = None
        self.device = torch.device("cpu")
        self.model = self.ref_model = self.optimizer = None  # the rest of the step's attributes: init()
        self._micro_batches = 0  # of the last forward_backward, for apply_update's metrics
        self._micro_batch_figures: dict[str, float] = {}  # its micro-batch times (micro_batch_metrics)
        self.memory = HandOver(self)
        self.frozen = self.frozen_hf_names = frozenset()

    # ------------------------------------------------------------------------------------
    # init
    # ------------------------------------------------------------------------------------

    def init(self) -> int:
        """Process groups, the policy stage, DDP + AdamW, the reference model (with a KL term), and the resume when
        ``--load`` holds a checkpoint; returns the next rollout id.

        Raises:
            CheckpointError: a weight flag's folder is not what it must be, or the checkpoint is malformed or
                incomplete.
            NotImplementedError: on CPU, flags only a CUDA run takes (:meth:`MegatronConfig.cpu_problem`: pipeline,
                tensor, context or expert parallelism, the all-to-all dispatcher).
            KernelUnavailable: the GPU kernels' packages are missing.
        """
        from megatron.core.distributed import finalize_model_grads

        from slime.backends.megatron.optimizer import DistributedAdam, LocalAdam

        self.optimizer_steps = 0
        self.device = init_world(self.rank_info)
        torch.manual_seed(self.spec.seed + self.rank_info.rank)
        init_model_parallel(self.megatron, self.device, self.spec.seed)
        self.groups = Groups.current()
        self.dp = DataParallel(self.groups.dp_rank, self.groups.dp_size, self.groups.dp_gloo, self.groups.tp_size,
                               computes_loss=self.groups.is_last_stage)
        if self.device.type == "cpu" and (problem := self.megatron.cpu_problem()):
            raise NotImplementedError(problem)
        if self.device.type == "cuda" and self.spec.train.bf16:
            self.dtype = torch.bfloat16
        elif self.spec.train.bf16:
            logger.info("--bf16 applies to GPU runs only; training on CPU in float32")

        start = resolve_weights(self.spec.checkpoint, need_reference=self.spec.grpo.needs_ref_model)
        self.model = self._build(start.policy, frozen=False)
        arch = self.model.qwen_config.arch
        self.placeholder_ids = {arch.image_token_id, arch.video_token_id} - {None}  # fed as a pad token (pack_micro_batch)
        self._route_shape = self._find_route_shape()
        self.frozen, self.frozen_hf_names = freeze_policy(self.model, self.spec.train, self._hf_names_by_param,
                                                          self.device)
        if self.device.type == "cuda":
            self.optimizer = DistributedAdam(self.model, self.megatron, self.spec.optimizer,
                                             bf16=self.dtype != torch.float32)
        else:
            from megatron.core import parallel_state as ps

            self.optimizer = LocalAdam(self.model, self.spec.optimizer, ps.get_data_parallel_group(),
                                       ps.get_tensor_model_parallel_group())
        config = self.model.config
        config.no_sync_func = self.optimizer.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        if start.reference is not None:
            self.ref_model = self._build(start.reference, frozen=True)
        resume_id = start.policy.rollout_id
        if resume_id is None:
            return 0
        self.optimizer_steps = mckpt.load_trainer_state(
            ckpt.trainer_dir(start.policy.path, resume_id), self.model, self.optimizer,
            load_optim=not self.spec.checkpoint.no_load_optim, frozen_hf=set(self.frozen_hf_names),
        )
        logger.info("resumed from %s (%d optimizer steps)", start.policy, self.optimizer_steps)
        return start.next_rollout_id

    def _build(self, source: WeightSource, *, frozen: bool):
        """This rank's stage of a model with the weights of ``source``: a Hugging Face folder is read while the
        model is built; a checkpoint's weights are filled in after, a frozen (reference) model's here, the
        policy's with its optimizer state (:func:`slime.backends.megatron.checkpoint.load_trainer_state`)."""
        if source.rollout_id is None:
            model = build_stage(source.path, self.megatron, dtype=self.dtype, device=self.device)
        else:
            model = build_stage(self.spec.checkpoint.hf_checkpoint, self.megatron, dtype=self.dtype, device=self.device,
                                load=False)
            if frozen:
                mckpt.load_weights(model, ckpt.trainer_dir(source.path, source.rollout_id) / mckpt.STATE_DIR)
        if frozen:
            model.requires_grad_(False)
        return model

    # ------------------------------------------------------------------------------------
    # the training step's backend (slime.backends.step.StepBackend); TP / PP peers get the same samples (dp)
    # ------------------------------------------------------------------------------------

    def pack(self, samples: list[Sample]) -> PackedBatch:
        """One THD micro-batch on the CPU (moved to the device by the forward step), padded to a multiple of
        TP under sequence parallelism."""
        pad = self.megatron.tensor_model_parallel_size if self.megatron.sequence_parallel else 1
        return pack_micro_batch(samples, list(range(len(samples))), self.model.qwen_config.arch,
                                torch.device("cpu"), pad_to_multiple_of=pad)

    def _context(self, **kw) -> LossContext:
        from megatron.core import parallel_state as ps

        return LossContext(temperature=self.spec.rollout_temperature, vocab_size=self.model.qwen_config.arch.vocab_size,
                           tp_group=ps.get_tensor_model_parallel_group(), device=self.device, **kw)

    def log_probs(self, model, batches: list[MicroBatch], *, replay_routes: bool = False,
                  capture_routes: bool = False) -> list[Tensor] | None:
        """Forward-only pass of the schedule; per sample ``[R]`` (CPU, fp32); None off the last pipeline stage.
        With ``replay_routes`` each micro-batch carries ``batch.routes``, with ``capture_routes`` the routers'
        choices go to ``batch.trainer_routes`` (:func:`slime.routing_replay.packed_routes`)."""
        from slime.models.qwen3_5.router import captured_routes

        was_training = model.training
        model.eval()
        shape = self._replay_shape(batches, replay_routes, capture_routes)
        with torch.no_grad(), packed_routes(batches, shape, replay=replay_routes,
                                            capture=captured_routes(model) if capture_routes else None) as packed:
            store = run_micro_batches(model, packed, make_forward_step(self._context(), log_prob_func),
                                      forward_only=True, device=self.device)
        model.train(was_training)
        if not self.groups.is_last_stage:
            return None
        return [lp for batch, out in zip(batches, store, strict=True)
                for lp in batch.packed.split(out["log_probs"].float().cpu())]

    def _replay_shape(self, batches: list[MicroBatch], replay: bool, capture: bool) -> RouteShape | None:
        """The policy's route shape where the pass replays some batch's routes or captures its own, else None."""
        needed = capture or (replay and any(b.routes is not None for b in batches))
        return self.route_shape() if needed else None

    def forward_backward(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        """Every micro-batch of the step through megatron-core's schedule with :func:`grpo_loss_func` (with
        ``batch.routes`` replayed where set)."""
        for batch in batches:
            if batch.old_log_probs is not None:
                batch.packed.old_log_probs = packed_per_token(batch.old_log_probs, "cpu")
            if batch.ref_log_probs is not None:
                batch.packed.ref_log_probs = packed_per_token(batch.ref_log_probs, "cpu")
            if batch.rollout_log_probs is not None:
                batch.packed.rollout_log_probs = packed_per_token(batch.rollout_log_probs, "cpu")
        ctx = self._context(grpo=self.spec.grpo, normalizer=normalizer, num_microbatches=len(batches),
                            dp_size=self.groups.dp_size,
                            whitening=next((b.advantage_whitening for b in batches), None))
        self._micro_batches = len(batches)
        model = self.optimizer.model
        clock = MicroBatchClock(self.device)
        with packed_routes(batches, self._replay_shape(batches, True, False), replay=True) as packed:
            store = run_micro_batches(model, packed, make_forward_step(ctx, grpo_loss_func, on_start=clock.mark),
                                      forward_only=False, device=self.device)
            clock.stop()
            self._micro_batch_figures = micro_batch_metrics(clock.seconds(), [p.num_tokens for p in packed])
        for batch, out in zip(batches, store):  # --skip-actor-forward-only: per sample, one copy to the host
            if FORWARD_LOG_PROBS in out:
                out[FORWARD_LOG_PROBS] = batch.packed.split(out[FORWARD_LOG_PROBS].float().cpu())
        return store

    def grad_norm(self) -> float:
        """The global gradient norm (megatron-core's distributed optimizer, or the CPU stand-in's)."""
        return self.optimizer.grad_norm()

    def apply_update(self, lr: float, grad_scale: float) -> dict[str, float]:
        """The optimizer's step at ``lr`` with the gradients scaled by ``grad_scale`` (the gradients zeroed after it);
        ``train/micro_batches``: this rank's micro-batches of the step, and the step's micro-batch times
        (:func:`slime.utils.timer.micro_batch_metrics`, this rank's)."""
        self.optimizer.step(lr, grad_scale)
        return {"train/micro_batches": float(self._micro_batches), **self._micro_batch_figures}

    def input_embedding(self) -> torch.nn.Module | None:
        """The first pipeline stage's ``VocabParallelEmbedding`` (None on later stages)."""
        return next((m for m in self.model.modules() if type(m).__name__ == "VocabParallelEmbedding"), None)

    def route_shape(self) -> RouteShape:
        """The policy's routed experts per position (found in ``init``); NotImplementedError in an unproven layout
        (:meth:`.config.MegatronConfig.replay_routes_problem`), RouteError beyond uint8's experts."""
        if isinstance(self._route_shape, Exception):
            raise self._route_shape
        return self._route_shape

    def _find_route_shape(self) -> RouteShape | Exception:
        problem = self.megatron.replay_routes_problem()
        if problem:
            return NotImplementedError(problem)
        arch = self.model.qwen_config.arch
        try:
            return RouteShape(arch.num_layers, arch.moe_router_topk, arch.num_experts, "the policy")
        except RouteError as e:
            return e

    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False,
                          replay_routes: bool = False) -> list[list[float]]:
        """:func:`slime.backends.step.compute_log_probs`, shared from the last pipeline stage with every stage."""
        out = compute_log_probs(self, samples, rounding_noise=rounding_noise, replay_routes=replay_routes)
        if self.groups.pp_size > 1:
            from megatron.core import parallel_state as ps

            box = [out]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            out = box[0]
        return out

    # ------------------------------------------------------------------------------------
    # weights out, checkpoints
    # ------------------------------------------------------------------------------------

    def iter_weight_buckets(
        self, bucket_bytes: int, device: str | torch.device | None = None, skip_frozen: bool = False
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """This rank's share of the weights by Hugging Face name in lockstep buckets of whole layers
        (:func:`.weight_export.iter_buckets`), in the parameters' dtype, on ``device`` (default: this rank's);
        ``skip_frozen``: the frozen parameters are neither gathered nor sent."""
        self.memory.require("iter_weight_buckets()", training=False)
        yield from iter_buckets(self.model, bucket_bytes, device=device or self.device,
                                skip=self.frozen if skip_frozen else frozenset())

    def _hf_names_by_param(self) -> dict[str, list[str]]:
        """Each native parameter's Hugging Face names (its export rule, :func:`slime.models.qwen3_5.weights.model_rules`)."""
        from slime.models.qwen3_5.weights import model_rules

        return {name: list(rule.hf_names) for name, rule in model_rules(self.model).items()}

    def save(self, rollout_id: int, path: Path) -> None:
        """Write ``path/trainer`` (:mod:`slime.backends.megatron.checkpoint`) and, with ``--save-hf``, the
        Hugging Face folder (``{rollout_id}`` in its path replaced). Collective."""
        self.memory.require_init()
        save_hf = self.megatron.save_hf.format(rollout_id=rollout_id) if self.megatron.save_hf else None
        layout = {"tensor_model_parallel_size": self.megatron.tensor_model_parallel_size,
                  "pipeline_model_parallel_size": self.megatron.pipeline_model_parallel_size,
                  "expert_model_parallel_size": self.megatron.expert_model_parallel_size,
                  "expert_tensor_parallel_size": self.megatron.expert_tensor_parallel,
                  "data_parallel_size": self.groups.dp_size, "dtype": str(self.dtype)}
        ckpt_cfg = self.spec.checkpoint
        mckpt.save_trainer_state(Path(path) / "trainer", self.model, self.optimizer, steps=self.optimizer_steps,
                                 save_optim=not ckpt_cfg.no_save_optim, layout=layout, save_hf=save_hf,
                                 hf_checkpoint=ckpt_cfg.hf_checkpoint, frozen_hf=set(self.frozen_hf_names))

    # ------------------------------------------------------------------------------------
    # colocated memory
    # ------------------------------------------------------------------------------------

    def move_part(self, part: str, onto_device: bool) -> None:
        """:data:`WEIGHTS`: the policy's parameter buffers; :data:`TRAINING_STATE`: gradient buffers, optimizer state
        and the reference model, through megatron-core's RL offload API (why not ``torch_memory_saver``:
        ``docs/design/training_step.md``)."""
        if part == WEIGHTS:
            self.optimizer.move_weights(onto_device)
            return
        self.optimizer.move_training_state(onto_device)
        if self.ref_model is not None:
            self.ref_model.to(self.device if onto_device else "cpu")


# ------------------------------------------------------------------------------------
# packed micro-batches and megatron-core's schedule (module docstring)
# ------------------------------------------------------------------------------------


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
        """The same micro-batch with every tensor on ``device`` (micro-batches wait on the CPU until run; to a CUDA
        device through pinned memory, without a host synchronisation: :func:`slime.models.qwen3_5.model.to_device`)."""
        move = lambda t: to_device(t, device)  # noqa: E731
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
        ids = model_input_ids(sample, placeholders)
        mm = sample.multimodal_inputs
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
    :func:`grpo_micro_batch_loss`); without ``old_log_probs`` (``--skip-actor-forward-only``) also the detached
    float32 ``[K]`` log-probs under :data:`slime.backends.step.FORWARD_LOG_PROBS`."""
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
    if batch.old_log_probs is None:  # --skip-actor-forward-only: the step's old log-probs ([K]) are these
        metrics[FORWARD_LOG_PROBS] = log_probs.detach()
    return loss * scale, one, {"loss": loss.detach(), **metrics}


def log_prob_func(ctx: LossContext, batch: PackedBatch, logits: Tensor):
    """megatron-core loss function of a forward-only pass: ``(0, ones(int), {"log_probs": [K] float32})``."""
    log_probs, _ = _log_probs(ctx, batch, logits, with_entropy=False)
    zero = log_probs.new_zeros(())
    return zero, torch.ones((), dtype=torch.int, device=zero.device), {"log_probs": log_probs.detach()}


def make_forward_step(ctx: LossContext, loss_func, on_start: Callable[[], None] | None = None):
    """megatron-core's ``forward_step_func`` over an iterator of :class:`PackedBatch` es (moved to
    ``ctx.device`` one at a time), with ``loss_func`` (:func:`grpo_loss_func` or :func:`log_prob_func`)
    bound to ``ctx`` and the micro-batch; ``on_start`` is called as each micro-batch starts."""

    def forward_step(data_iterator, model):
        if on_start is not None:
            on_start()
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
    the bare model for forward-only passes); ``forward_step_func`` from :func:`make_forward_step`.  Returns the
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
