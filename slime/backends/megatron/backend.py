"""``--train-backend megatron``: GRPO on the native Megatron Qwen3.5 model (:mod:`slime.models.qwen3_5`).

One :class:`MegatronBackend` per rank.  ``init`` builds megatron-core's parallel state (:mod:`.parallel`), this rank's
pipeline stage (:mod:`.model`), DDP and AdamW (:mod:`.optimizer`) and, with a KL term, a reference model.  It is the
training step's backend (:class:`slime.backends.step.StepBackend`): packed THD micro-batches through megatron-core's
forward-backward schedule with the shared GRPO loss over vocab-parallel log-probs (:mod:`.batches`).  Weights leave by
Hugging Face name (:mod:`.weight_export`); checkpoints: :mod:`.checkpoint`.  Precision: ``--bf16`` on GPU trains bf16
parameters with fp32 main weights and moments (``A_log`` stays fp32); on CPU everything is fp32 and only data
parallelism runs; log-probs and losses are fp32.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import ClassVar, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.config import RankInfo, TrainerSpec
from slime.backends.freeze import freeze_policy
from slime.backends.handover import WEIGHTS, HandOver
from slime.backends.megatron import checkpoint as mckpt
from slime.backends.megatron.batches import (
    LossContext, PackedBatch, grpo_loss_func, log_prob_func, make_forward_step, pack_micro_batch, packed_per_token,
    run_micro_batches, split_routes, with_routes,
)
from slime.backends.megatron.config import MegatronConfig
from slime.backends.megatron.model import build_stage
from slime.backends.megatron.parallel import Groups, init_model_parallel, init_world
from slime.backends.megatron.weight_export import iter_buckets
from slime.backends.step import MicroBatch, compute_log_probs
from slime.backends.train_metrics import DataParallel
from slime.backends.weight_sources import WeightSource, resolve_weights
from slime.checkpoints import layout as ckpt
from slime.data.sample import Sample
from slime.routing_replay import RouteError, RouteShape

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
            NotImplementedError: pipeline, tensor or expert parallelism on CPU.
            KernelUnavailable: the GPU kernels' packages are missing.
        """
        from megatron.core.distributed import finalize_model_grads

        from slime.backends.megatron.optimizer import DistributedAdam, LocalAdam

        self.optimizer_steps = 0
        self.device = init_world(self.rank_info)
        torch.manual_seed(self.spec.seed + self.rank_info.rank)
        init_model_parallel(self.megatron, self.device, self.spec.seed)
        self.groups = Groups.current()
        self.dp = DataParallel(self.groups.dp_rank, self.groups.dp_size, self.groups.dp_gloo, self.groups.tp_size)
        layout = self.megatron.model_parallel_size * self.megatron.expert_model_parallel_size
        if self.device.type == "cpu" and layout > 1:
            raise NotImplementedError(
                "the Megatron backend on CPU runs data parallelism only: megatron-core's pipeline schedules, its "
                "token all-to-all, its sequence-parallel gathers (which MoE training with TP > 1 requires) and its "
                "CUDA RNG tracker need CUDA; use TP = PP = EP = 1 on CPU, or a GPU"
            )
        if self.device.type == "cuda" and self.spec.train.bf16:
            self.dtype = torch.bfloat16
        elif self.spec.train.bf16:
            logger.info("--bf16 applies to GPU runs only; training on CPU in float32")

        start = resolve_weights(self.spec.checkpoint, need_reference=self.spec.grpo.needs_ref_model)
        self.model = self._build(start.policy, frozen=False)
        arch = self.model.qwen_config.arch
        self.placeholder_ids = {arch.image_token_id, arch.video_token_id} - {None}  # fed as a pad token (batches.py)
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
        With ``replay_routes`` each micro-batch carries ``batch.routes`` (:func:`.batches.with_routes`); with
        ``capture_routes`` the routers' choices go to ``batch.trainer_routes`` (:func:`captured_routes`)."""
        from slime.models.qwen3_5.router import captured_routes

        packed = self._with_routes(batches) if replay_routes else [b.packed for b in batches]
        was_training = model.training
        model.eval()
        with torch.no_grad(), (captured_routes(model) if capture_routes else contextlib.nullcontext()) as calls:
            store = run_micro_batches(model, packed,
                                      make_forward_step(self._context(), log_prob_func),
                                      forward_only=True, device=self.device)
        model.train(was_training)
        if calls is not None:
            shape = self.route_shape()
            for i, batch in enumerate(batches):
                token_axis = torch.stack([calls[layer][i] for layer in range(1, shape.num_layers + 1)], dim=1)
                batch.trainer_routes = split_routes(batch.packed, token_axis.numpy(), shape)
        if not self.groups.is_last_stage:
            return None
        return [lp for batch, out in zip(batches, store, strict=True)
                for lp in batch.packed.split(out["log_probs"].float().cpu())]

    def _with_routes(self, batches: list[MicroBatch]) -> list[PackedBatch]:
        """Each batch's packed form with ``batch.routes`` on its token axis (as it is where they are None)."""
        shape = self.route_shape() if any(b.routes is not None for b in batches) else None
        return [b.packed if b.routes is None else with_routes(b.packed, b.routes, shape) for b in batches]

    def forward_backward(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        """Every micro-batch of the step through megatron-core's schedule with :func:`.batches.grpo_loss_func` (with
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
        self.optimizer.zero_grad()
        return run_micro_batches(self.optimizer.model, self._with_routes(batches),
                                 make_forward_step(ctx, grpo_loss_func), forward_only=False, device=self.device)

    def grad_norm(self) -> float:
        """The global gradient norm (megatron-core's distributed optimizer, or the CPU stand-in's)."""
        return self.optimizer.grad_norm()

    def apply_update(self, lr: float, grad_scale: float) -> None:
        """The optimizer's step at ``lr`` with the gradients scaled by ``grad_scale``."""
        self.optimizer.step(lr, grad_scale)

    def step_metrics(self, batches: list[MicroBatch]) -> dict[str, float]:
        """``train/micro_batches``: this rank's micro-batches of the step."""
        return {"train/micro_batches": float(len(batches))}

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
