"""``--train-backend megatron``: GRPO on the native Megatron Qwen3.5 model (:mod:`slime.models.qwen3_5`).

One :class:`MegatronBackend` per rank.  ``init`` builds megatron-core's parallel state (:mod:`.parallel`), this rank's
pipeline stage (:mod:`.model`), DDP and AdamW (:mod:`.optimizer`) and, with a KL term, a reference model.  It
supplies the shared step's hooks: packed THD micro-batches (:mod:`.batches`) through megatron-core's forward-backward
schedule (:mod:`.schedule`) with the shared GRPO loss over vocab-parallel log-probs (:mod:`.loss`).  Weights leave by
Hugging Face name (:mod:`.weight_export`); checkpoints: :mod:`.checkpoint`.  Precision: ``--bf16`` on GPU trains bf16
parameters with fp32 main weights and moments (``A_log`` stays fp32); on CPU everything is fp32 and only data
parallelism runs; log-probs and losses are fp32.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.base import WEIGHTS, MicroBatch, RankInfo, TrainerBackend
from slime.backends.megatron import checkpoint as mckpt
from slime.backends.megatron.batches import (
    PackedBatch, pack_micro_batch, packed_per_token, split_routes, with_routes,
)
from slime.backends.megatron.config import MegatronConfig
from slime.backends.megatron.loss import LossContext, grpo_loss_func, log_prob_func, make_forward_step
from slime.backends.megatron.model import build_stage
from slime.backends.megatron.parallel import Groups, init_model_parallel, init_world
from slime.backends.megatron.schedule import run_micro_batches
from slime.backends.megatron.weight_export import iter_buckets
from slime.backends.weight_sources import WeightSource, resolve_weights
from slime.checkpoints import layout as ckpt
from slime.data.routes import RouteShape
from slime.data.sample import Sample

logger = logging.getLogger(__name__)


class MegatronBackend(TrainerBackend):
    """One rank of the Megatron trainer (module docstring); every public method is collective.  ``megatron``: its
    BACKEND_ARGS; ``kwargs``: :class:`~slime.backends.base.TrainerBackend`'s (whose errors it raises)."""

    config_group = "megatron"

    def __init__(self, rank_info: RankInfo, *, megatron: MegatronConfig, **kwargs):
        super().__init__(rank_info, **kwargs)
        self.megatron = megatron
        self.dtype = torch.float32
        self.groups: Groups | None = None

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

        self.device = init_world(self.rank_info)
        torch.manual_seed(self.seed + self.rank_info.rank)
        init_model_parallel(self.megatron, self.device, self.seed)
        self.groups = Groups.current()
        layout = self.megatron.model_parallel_size * self.megatron.expert_model_parallel_size
        if self.device.type == "cpu" and layout > 1:
            raise NotImplementedError(
                "the Megatron backend on CPU runs data parallelism only: megatron-core's pipeline schedules, its "
                "token all-to-all, its sequence-parallel gathers (which MoE training with TP > 1 requires) and its "
                "CUDA RNG tracker need CUDA; use TP = PP = EP = 1 on CPU, or a GPU"
            )
        if self.device.type == "cuda" and self.train_cfg.bf16:
            self.dtype = torch.bfloat16
        elif self.train_cfg.bf16:
            logger.info("--bf16 applies to GPU runs only; training on CPU in float32")

        start = resolve_weights(self.ckpt_cfg, need_reference=self.grpo.needs_ref_model)
        self.model = self._build(start.policy, frozen=False)
        self._freeze_policy()
        if self.device.type == "cuda":
            self.optimizer = DistributedAdam(self.model, self.megatron, self.optim_cfg,
                                             bf16=self.dtype != torch.float32)
        else:
            from megatron.core import parallel_state as ps

            self.optimizer = LocalAdam(self.model, self.optim_cfg, ps.get_data_parallel_group(),
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
            load_optim=not self.ckpt_cfg.no_load_optim, frozen_hf=set(self.frozen_hf_names),
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
            model = build_stage(self.ckpt_cfg.hf_checkpoint, self.megatron, dtype=self.dtype, device=self.device,
                                load=False)
            if frozen:
                mckpt.load_weights(model, ckpt.trainer_dir(source.path, source.rollout_id) / mckpt.STATE_DIR)
        if frozen:
            model.requires_grad_(False)
        return model

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """megatron-core's data-parallel rank and size: TP / PP peers of one replica get the same samples."""
        self._require_init()
        return self.groups.dp_rank, self.groups.dp_size

    # ------------------------------------------------------------------------------------
    # the training step's hooks (TrainerBackend.train)
    # ------------------------------------------------------------------------------------

    def _pack(self, samples: list[Sample]) -> PackedBatch:
        """One THD micro-batch on the CPU (moved to the device by the forward step), padded to a multiple of
        TP under sequence parallelism."""
        pad = self.megatron.tensor_model_parallel_size if self.megatron.sequence_parallel else 1
        return pack_micro_batch(samples, list(range(len(samples))), self.model.qwen_config.arch,
                                torch.device("cpu"), pad_to_multiple_of=pad)

    def _context(self, **kw) -> LossContext:
        from megatron.core import parallel_state as ps

        return LossContext(temperature=self.temperature, vocab_size=self.model.qwen_config.arch.vocab_size,
                           tp_group=ps.get_tensor_model_parallel_group(), device=self.device, **kw)

    def _forward_log_probs(self, model, batches: list[MicroBatch], *, replay_routes: bool = False,
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
            shape = self._route_shape()
            for i, batch in enumerate(batches):
                token_axis = torch.stack([calls[layer][i] for layer in range(1, shape.num_layers + 1)], dim=1)
                batch.trainer_routes = split_routes(batch.packed, token_axis.numpy(), shape)
        if not self.groups.is_last_stage:
            return None
        return [lp for batch, out in zip(batches, store, strict=True)
                for lp in batch.packed.split(out["log_probs"].float().cpu())]

    def _with_routes(self, batches: list[MicroBatch]) -> list[PackedBatch]:
        """Each batch's packed form with ``batch.routes`` on its token axis (as it is where they are None)."""
        shape = self._route_shape() if any(b.routes is not None for b in batches) else None
        return [b.packed if b.routes is None else with_routes(b.packed, b.routes, shape) for b in batches]

    def _forward_backward(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        """Every micro-batch of the step through megatron-core's schedule with :func:`.loss.grpo_loss_func` (with
        ``batch.routes`` replayed where set)."""
        for batch in batches:
            if batch.old_log_probs is not None:
                batch.packed.old_log_probs = packed_per_token(batch.old_log_probs, "cpu")
            if batch.ref_log_probs is not None:
                batch.packed.ref_log_probs = packed_per_token(batch.ref_log_probs, "cpu")
            if batch.rollout_log_probs is not None:
                batch.packed.rollout_log_probs = packed_per_token(batch.rollout_log_probs, "cpu")
        ctx = self._context(grpo=self.grpo, normalizer=normalizer, num_microbatches=len(batches),
                            dp_size=self.groups.dp_size,
                            whitening=next((b.advantage_whitening for b in batches), None))
        self.optimizer.zero_grad()
        return run_micro_batches(self.optimizer.model, self._with_routes(batches),
                                 make_forward_step(ctx, grpo_loss_func), forward_only=False, device=self.device)

    def _grad_norm(self) -> float:
        return self.optimizer.grad_norm()

    def _apply_update(self, lr: float, grad_scale: float) -> None:
        self.optimizer.step(lr, grad_scale)

    def _placeholder_ids(self) -> set[int]:
        arch = self.model.qwen_config.arch
        return {arch.image_token_id, arch.video_token_id} - {None}  # fed as a pad token (batches.py)

    def _dp_group(self):
        return self.groups.dp_gloo

    def _metric_sum(self, values: dict[str, float]) -> dict[str, float]:
        return self.groups.metric_sum(values)

    def _step_metrics(self, batches: list[MicroBatch]) -> dict[str, float]:
        """``train/micro_batches``: this rank's micro-batches of the step."""
        return {"train/micro_batches": float(len(batches))}

    def _input_embedding(self) -> torch.nn.Module | None:
        """The first pipeline stage's ``VocabParallelEmbedding`` (None on later stages)."""
        return next((m for m in self.model.modules() if type(m).__name__ == "VocabParallelEmbedding"), None)

    def _route_shape(self) -> RouteShape:
        """NotImplementedError in an unproven layout (:meth:`.config.MegatronConfig.replay_routes_problem`)."""
        problem = self.megatron.replay_routes_problem()
        if problem:
            raise NotImplementedError(problem)
        arch = self.model.qwen_config.arch
        return RouteShape(arch.num_layers, arch.moe_router_topk, arch.num_experts, "the policy")

    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False,
                          replay_routes: bool = False) -> list[list[float]]:
        """:meth:`TrainerBackend.compute_log_probs`, shared from the last pipeline stage with every stage."""
        out = super().compute_log_probs(samples, rounding_noise=rounding_noise, replay_routes=replay_routes)
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
        self._require_init()
        self._require_on_device("iter_weight_buckets()", training=False)
        yield from iter_buckets(self.model, bucket_bytes, device=device or self.device,
                                skip=self.frozen if skip_frozen else frozenset())

    def _hf_names_by_param(self) -> dict[str, list[str]]:
        """Each native parameter's Hugging Face names (its export rule, :func:`slime.models.qwen3_5.weights.model_rules`)."""
        from slime.models.qwen3_5.weights import model_rules

        return {name: list(rule.hf_names) for name, rule in model_rules(self.model).items()}

    def save(self, rollout_id: int, path: Path) -> None:
        """Write ``path/trainer`` (:mod:`slime.backends.megatron.checkpoint`) and, with ``--save-hf``, the
        Hugging Face folder (``{rollout_id}`` in its path replaced). Collective."""
        self._require_init()
        save_hf = self.megatron.save_hf.format(rollout_id=rollout_id) if self.megatron.save_hf else None
        layout = {"tensor_model_parallel_size": self.megatron.tensor_model_parallel_size,
                  "pipeline_model_parallel_size": self.megatron.pipeline_model_parallel_size,
                  "expert_model_parallel_size": self.megatron.expert_model_parallel_size,
                  "expert_tensor_parallel_size": self.megatron.expert_tensor_parallel,
                  "data_parallel_size": self.groups.dp_size, "dtype": str(self.dtype)}
        mckpt.save_trainer_state(Path(path) / "trainer", self.model, self.optimizer, steps=self.optimizer_steps,
                                 save_optim=not self.ckpt_cfg.no_save_optim, layout=layout, save_hf=save_hf,
                                 hf_checkpoint=self.ckpt_cfg.hf_checkpoint, frozen_hf=set(self.frozen_hf_names))

    # ------------------------------------------------------------------------------------
    # colocated memory
    # ------------------------------------------------------------------------------------

    def _move_part(self, part: str, onto_device: bool) -> None:
        """:data:`WEIGHTS`: the policy's parameter buffers; :data:`TRAINING_STATE`: gradient buffers, optimizer state
        and the reference model, through megatron-core's RL offload API (why not ``torch_memory_saver``:
        ``docs/design/training_step.md``)."""
        if part == WEIGHTS:
            self.optimizer.move_weights(onto_device)
            return
        self.optimizer.move_training_state(onto_device)
        if self.ref_model is not None:
            self.ref_model.to(self.device if onto_device else "cpu")
