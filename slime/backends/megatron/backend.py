"""``--train-backend megatron``: GRPO on the native Megatron Qwen3.5 model (slime.models.qwen3_5).

One :class:`MegatronBackend` per rank.  ``init`` joins the trainer world, builds megatron-core's
parallel state (TP, PP, EP, expert-TP, DP; :mod:`.parallel`), this rank's pipeline stage of the model
loaded from ``--hf-checkpoint`` (:mod:`.model`), the gradient reduction and AdamW (:mod:`.optimizer`:
megatron-core's DDP and distributed optimizer on GPU), a reference model only when a KL coefficient is
non-zero, and resumes from ``--load``.  What a rollout's :meth:`MegatronBackend.train` does, in order:

1. cut this rank's samples into ``num_steps`` optimizer steps and each step into packed THD
   micro-batches (:mod:`.batches`: ``--micro-batch-size`` samples, or ``--use-dynamic-batch-size``
   bins of ``--max-tokens-per-gpu`` tokens);
2. old log-probs: a forward-only pass of the current policy over every micro-batch before any update
   (or the engines' log-probs with ``--use-rollout-logprobs``), reference log-probs likewise; the
   train-vs-rollout gap (:mod:`slime.backends.train_metrics`, split into image and text prompts);
3. per step: megatron-core's forward-backward schedule over the micro-batches (:mod:`.schedule`) with
   the shared GRPO loss over vocab-parallel log-probs at ``logits / --rollout-temperature``
   (:mod:`.loss`), normalised by the step's global sample (or token) count; gradient norm (checked
   finite), ``--clip-grad``, AdamW at the rate of :class:`slime.backends.lr_schedule.LRSchedule`.

Weights leave by Hugging Face name (:mod:`.weight_export`, vision tower included); checkpoints are a
``torch.distributed.checkpoint`` of Hugging Face-named fp32 tensors plus optimizer moments, scheduler
and RNG (:mod:`.checkpoint`); colocated runs offload gradients, optimizer state and (without
``keep_weights``) the weights with megatron-core's buffer-offload API, and onload the weights alone for a
mid-rollout re-sync (:meth:`MegatronBackend._move_part`, under the shared :meth:`TrainerBackend.offload`).

Precision: ``--bf16`` on GPU trains bf16 parameters with fp32 main weights and moments in the
distributed optimizer (``A_log`` stays fp32); ``--accumulate-allreduce-grads-in-fp32`` accumulates and
reduces gradients in fp32.  On CPU everything is fp32 (``--bf16`` ignored) and only data parallelism
runs (:mod:`.optimizer` and :mod:`.schedule` say what megatron-core does not do without CUDA).
Log-probs and losses are fp32.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.base import WEIGHTS, RankInfo, TrainerBackend
from slime.backends.batching import check_train_samples, loss_normalizer, split_into_steps
from slime.backends.config import CheckpointConfig, OptimizerConfig, TrainConfig
from slime.backends.lr_schedule import LRSchedule
from slime.backends.rounding import rounding_step_noise
from slime.backends.megatron import checkpoint as mckpt
from slime.backends.megatron.batches import MicroBatch, pack_micro_batch, packed_per_token, plan_micro_batches
from slime.backends.megatron.config import MegatronConfig
from slime.backends.megatron.loss import LossContext, grpo_loss_func, log_prob_func, make_forward_step
from slime.backends.megatron.model import build_stage
from slime.backends.megatron.parallel import Groups, init_model_parallel, init_world
from slime.backends.megatron.schedule import run_micro_batches
from slime.backends.megatron.weight_export import iter_buckets
from slime.backends.train_metrics import logprob_gap_metrics, logprob_gap_sums
from slime.checkpoints import layout as ckpt
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig

logger = logging.getLogger(__name__)


class MegatronBackend(TrainerBackend):
    """One rank of the Megatron trainer (see the module docstring). Every method is collective.

    Args:
        rank_info: this rank's place in the trainer world.
        train: BACKEND_ARGS (micro-batching, ``--bf16``, ``--use-rollout-logprobs``).
        megatron: BACKEND_ARGS (megatron).
        optimizer: OPTIMIZER_ARGS.
        grpo: the GRPO loss flags; ``grpo.needs_ref_model`` decides the reference model.
        checkpoint: CKPT_ARGS (``hf_checkpoint``, ``load``, ``ref_load``, ``no_save_optim``, ``no_load_optim``).
        rollout_temperature: ``--rollout-temperature`` (> 0).
        num_rollout: rollout steps of the run (None: unknown; a decaying schedule then needs
            ``--lr-decay-iters``).
        num_steps_per_rollout: optimizer steps per rollout.
        seed: base seed; rank ``r`` seeds torch with ``seed + r``.

    Raises:
        ValueError: ``num_steps_per_rollout < 1``.
        ConfigError: an inconsistent LR schedule (see :class:`LRSchedule`).
    """

    def __init__(
        self,
        rank_info: RankInfo,
        *,
        train: TrainConfig,
        megatron: MegatronConfig,
        optimizer: OptimizerConfig,
        grpo: GRPOConfig,
        checkpoint: CheckpointConfig,
        rollout_temperature: float,
        num_rollout: int | None,
        num_steps_per_rollout: int,
        seed: int = 0,
    ):
        if num_steps_per_rollout < 1:
            raise ValueError(f"num_steps_per_rollout must be >= 1, got {num_steps_per_rollout}")
        self.rank_info = rank_info
        self.train_cfg, self.megatron, self.optim_cfg = train, megatron, optimizer
        self.grpo, self.ckpt_cfg = grpo, checkpoint
        self.temperature = rollout_temperature
        self.seed = seed
        total = None if num_rollout is None else num_rollout * num_steps_per_rollout
        self.lr_schedule = LRSchedule.from_config(optimizer, total)
        self.optimizer_steps = 0
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model = self.ref_model = self.optimizer = None
        self.groups: Groups | None = None

    @classmethod
    def from_config(cls, cfg, rank_info: RankInfo) -> "MegatronBackend":
        """Build from the run's :class:`slime.arguments.SlimeConfig` (what the trainer group calls)."""
        return cls(
            rank_info, train=cfg.train, megatron=cfg.megatron, optimizer=cfg.optimizer, grpo=cfg.grpo,
            checkpoint=cfg.checkpoint, rollout_temperature=cfg.rollout.rollout_temperature,
            num_rollout=cfg.rollout.num_rollout,
            num_steps_per_rollout=max(1, cfg.rollout.samples_per_rollout // cfg.train.global_batch_size),
            seed=cfg.cluster.seed,
        )

    # ------------------------------------------------------------------------------------
    # init
    # ------------------------------------------------------------------------------------

    def init(self) -> int:
        """Process groups, the policy stage, gradient reduction + AdamW, the reference model (only when
        ``grpo.needs_ref_model``), and the resume from ``--load``.

        Returns:
            0 for a fresh run, ``k + 1`` after loading the checkpoint of rollout ``k``.

        Raises:
            CheckpointError: ``--hf-checkpoint`` / ``--ref-load`` is not a model folder, or ``--load`` is
                malformed or lacks what it must hold.
            NotImplementedError: pipeline or expert parallelism on CPU.
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

        ckpt.check_hf_folder(self.ckpt_cfg.hf_checkpoint)
        load_root = self.ckpt_cfg.load
        resume_id = ckpt.latest_iteration(load_root) if load_root else None
        source = self._initial_weights(load_root, resume_id)
        self.model = build_stage(source, self.megatron, dtype=self.dtype, device=self.device,
                                 load=resume_id is None)
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
        if self.grpo.needs_ref_model:
            self.ref_model = self._build_reference()
        if resume_id is None:
            return 0
        self.optimizer_steps = mckpt.load_trainer_state(
            ckpt.trainer_dir(load_root, resume_id), self.model, self.optimizer,
            load_optim=not self.ckpt_cfg.no_load_optim,
        )
        logger.info("resumed from %s (rollout %d, %d optimizer steps)", load_root, resume_id, self.optimizer_steps)
        return resume_id + 1

    def _initial_weights(self, load_root: str | None, resume_id: int | None) -> Path:
        """Where a fresh run's weights come from: ``--load`` when it is a Hugging Face folder without a slime
        checkpoint in it (upstream's ``--load <hf dir>``), else ``--hf-checkpoint``."""
        if resume_id is None and load_root and (Path(load_root) / "config.json").is_file():
            ckpt.check_hf_folder(load_root, "--load")
            logger.info("--load %s is a Hugging Face folder: the policy starts from its weights", load_root)
            return Path(load_root)
        if load_root and resume_id is None:
            logger.info("--load %s holds no checkpoint yet; starting from --hf-checkpoint", load_root)
        return Path(self.ckpt_cfg.hf_checkpoint)

    def _build_reference(self):
        """The frozen reference model: ``--ref-load`` (a slime checkpoint root: its latest checkpoint's
        weights; or a Hugging Face folder), else the initial weights of ``--hf-checkpoint``."""
        ref_load = self.ckpt_cfg.ref_load
        latest = ckpt.latest_iteration(ref_load) if ref_load else None
        if latest is not None:
            model = build_stage(self.ckpt_cfg.hf_checkpoint, self.megatron, dtype=self.dtype, device=self.device,
                                load=False)
            mckpt.load_weights(model, ckpt.trainer_dir(ref_load, latest) / mckpt.STATE_DIR)
        else:
            folder = ref_load or self.ckpt_cfg.hf_checkpoint
            ckpt.check_hf_folder(folder, "--ref-load" if ref_load else "--hf-checkpoint")
            model = build_stage(folder, self.megatron, dtype=self.dtype, device=self.device)
        model.requires_grad_(False)
        return model

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """megatron-core's data-parallel rank and size: TP / PP peers of one replica get the same samples."""
        self._require_init()
        return self.groups.dp_rank, self.groups.dp_size

    # ------------------------------------------------------------------------------------
    # micro-batches and forward-only passes
    # ------------------------------------------------------------------------------------

    def _micro_batches(self, samples: Sequence[Sample], dp_group) -> list[MicroBatch]:
        arch = self.model.qwen_config.arch
        pad = self.megatron.tensor_model_parallel_size if self.megatron.sequence_parallel else 1
        max_tokens = self.train_cfg.max_tokens_per_gpu if self.train_cfg.use_dynamic_batch_size else None
        plan = plan_micro_batches(samples, micro_batch_size=self.train_cfg.micro_batch_size, max_tokens=max_tokens,
                                  dp_group=dp_group)
        return [pack_micro_batch([samples[i] for i in idx], idx, arch, torch.device("cpu"), pad_to_multiple_of=pad)
                for idx in plan]

    def _context(self, **kw) -> LossContext:
        from megatron.core import parallel_state as ps

        return LossContext(temperature=self.temperature, vocab_size=self.model.qwen_config.arch.vocab_size,
                           tp_group=ps.get_tensor_model_parallel_group(), device=self.device, **kw)

    def _forward_log_probs(self, model, batches: Sequence[MicroBatch]) -> list[Tensor] | None:
        """No-grad log-probs ``[K]`` (CPU, fp32) of each micro-batch; None off the last pipeline stage."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            store = run_micro_batches(model, batches, make_forward_step(self._context(), log_prob_func),
                                      forward_only=True, device=self.device)
        model.train(was_training)
        if not self.groups.is_last_stage:
            return None
        return [out["log_probs"].float().cpu() for out in store]

    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False) -> list[list[float]]:
        """Per-token log-probs (nats) of each response under the current policy at ``--rollout-temperature``
        (no grad); every rank passes the same samples and returns the same lists.  ``rounding_noise``: see
        :meth:`TrainerBackend.compute_log_probs` (on the first pipeline stage's token embedding).

        Raises:
            SampleError: a malformed sample on any rank.
        """
        self._require_init()
        self._require_on_device("compute_log_probs()", training=False)
        check_train_samples(samples)
        batches = self._micro_batches(samples, dp_group=None)
        embedding = next((m for m in self.model.modules() if type(m).__name__ == "VocabParallelEmbedding"), None)
        with rounding_step_noise(embedding if rounding_noise else None):
            per_batch = self._forward_log_probs(self.model, batches)
        out: list[list[float] | None] = [None] * len(samples)
        if per_batch is not None:
            for batch, log_probs in zip(batches, per_batch):
                for i, lp in zip(batch.indices, batch.split(log_probs)):
                    out[i] = lp.tolist()
        if self.groups.pp_size > 1:
            from megatron.core import parallel_state as ps

            box = [out]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            out = box[0]
        return out

    # ------------------------------------------------------------------------------------
    # training
    # ------------------------------------------------------------------------------------

    def train(self, rollout_id: int, samples: list[Sample], num_steps: int) -> dict[str, float]:
        """``num_steps`` optimizer steps over this rank's samples; see the module docstring.

        Returns:
            Metrics averaged over the steps, identical on every rank: ``train/loss``, ``train/pg_loss``,
            ``train/pg_clipfrac``, ``train/ppo_kl``, ``train/entropy``, ``train/kl_loss`` (with a KL loss),
            ``train/grad_norm`` (before clipping), ``train/lr``, ``train/micro_batches`` (per step and rank),
            the log-prob gap ``train/logprob_abs_diff`` with ``_image`` / ``_text`` splits (unless
            ``--use-rollout-logprobs``), and colocated on GPU this rank's free memory around the offloads /
            onloads since the last ``train`` (``perf/{train,resync}_free_gib_*``,
            :meth:`TrainerBackend.memory_metrics`).

        Raises:
            SampleError: a malformed sample on any rank.
            ValueError: ``len(samples)`` is not a positive multiple of ``num_steps``.
            NonFiniteGradNorm: the gradient norm is not finite (no update applied).
            RuntimeError: the optimizer state is offloaded (no :meth:`onload` after :meth:`offload`).
        """
        self._require_init()
        self._require_on_device("train()", training=True)
        check_train_samples(samples, need_rollout_log_probs=self.train_cfg.use_rollout_logprobs)
        steps = split_into_steps(list(range(len(samples))), num_steps)
        plans = []
        for indices in steps:
            step_samples = [samples[i] for i in indices]
            batches = self._micro_batches(step_samples, dp_group=self.groups.dp_gloo)
            for batch in batches:
                batch.indices = [indices[i] for i in batch.indices]
            plans.append(batches)
        everything = [b for batches in plans for b in batches]
        gap = self._attach_old_log_probs(samples, everything)
        if self.ref_model is not None:
            ref = self._forward_log_probs(self.ref_model, everything)
            for batch, log_probs in zip(everything, ref or [None] * len(everything)):
                batch.ref_log_probs = log_probs

        self.model.train()
        totals: dict[str, float] = defaultdict(float)
        for batches in plans:
            for name, value in self._optimizer_step(rollout_id, [samples[i] for b in batches for i in b.indices],
                                                    batches).items():
                totals[name] += value
        metrics = {name: value / num_steps for name, value in totals.items()}
        metrics.update(gap)
        metrics.update(self.memory_metrics())
        return metrics

    def _attach_old_log_probs(self, samples: Sequence[Sample], batches: Sequence[MicroBatch]) -> dict[str, float]:
        """Set each micro-batch's old log-probs; returns the train-vs-rollout gap metrics (trainer pass only)."""
        if self.train_cfg.use_rollout_logprobs:
            for batch in batches:
                batch.old_log_probs = packed_per_token([samples[i].rollout_log_probs for i in batch.indices], "cpu")
            return {}
        per_batch = self._forward_log_probs(self.model, batches)
        arch = self.model.qwen_config.arch
        placeholders = {arch.image_token_id, arch.video_token_id} - {None}  # fed as a pad token (batches.py)
        sums = logprob_gap_sums([], [])  # every key at 0: earlier pipeline stages contribute nothing
        if per_batch is not None:
            for batch, log_probs in zip(batches, per_batch):
                batch.old_log_probs = log_probs
                part = logprob_gap_sums([samples[i] for i in batch.indices], batch.split(log_probs), placeholders)
                for k, v in part.items():
                    sums[k] += v
        return logprob_gap_metrics(self.groups.metric_sum(sums))

    def _metric_keys(self) -> list[str]:
        keys = ["loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy"]
        if self.grpo.use_kl_loss and self.ref_model is not None:
            keys.append("kl_loss")
        return keys

    def _optimizer_step(self, rollout_id: int, step_samples: list[Sample], batches: list[MicroBatch]) -> dict:
        """One optimizer step over this rank's micro-batches; returns its reduced metrics."""
        normalizer = loss_normalizer(step_samples, per_token=self.grpo.calculate_per_token_loss,
                                     group=self.groups.dp_gloo)
        lr = self.lr_schedule(self.optimizer_steps)
        ctx = self._context(grpo=self.grpo, normalizer=normalizer, num_microbatches=len(batches),
                            dp_size=self.groups.dp_size)
        self.optimizer.zero_grad()
        store = run_micro_batches(self.optimizer.model, batches, make_forward_step(ctx, grpo_loss_func),
                                  forward_only=False, device=self.device)
        sums = {f"train/{k}": 0.0 for k in self._metric_keys()}
        for out in store:
            for k in self._metric_keys():
                sums[f"train/{k}"] += float(out[k].double().cpu())
        where = f"rollout {rollout_id}, optimizer step {self.optimizer_steps}"
        grad_norm = self.optimizer.step(lr, where)
        self.optimizer_steps += 1
        return {**self.groups.metric_sum(sums), "train/grad_norm": grad_norm, "train/lr": lr,
                "train/micro_batches": float(len(batches))}

    # ------------------------------------------------------------------------------------
    # weights out, checkpoints
    # ------------------------------------------------------------------------------------

    def iter_weight_buckets(
        self, bucket_bytes: int, device: str | torch.device | None = None
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """This rank's share of the weights by Hugging Face name, in lockstep buckets of whole layers
        (:func:`slime.backends.megatron.weight_export.iter_buckets`), in the parameters' dtype (bf16 with
        ``--bf16`` on GPU, ``A_log`` fp32), on ``device`` (default: this rank's)."""
        self._require_init()
        self._require_on_device("iter_weight_buckets()", training=False)
        yield from iter_buckets(self.model, bucket_bytes, device=device or self.device)

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
                                 hf_checkpoint=self.ckpt_cfg.hf_checkpoint)

    # ------------------------------------------------------------------------------------
    # colocated memory
    # ------------------------------------------------------------------------------------

    def _move_part(self, part: str, onto_device: bool) -> None:
        """Colocated offload (:meth:`TrainerBackend.offload` / :meth:`~TrainerBackend.onload` decide what and
        when): :data:`WEIGHTS` is the policy's parameter buffers; :data:`TRAINING_STATE` the gradient buffers,
        the optimizer state (fp32 main weights, Adam moments) and the reference model
        (:meth:`slime.backends.megatron.optimizer.DistributedAdam.move_weights` / ``move_training_state``).

        It uses megatron-core's own RL offload API (``offload_grad_buffers``, the optimizers'
        ``offload_to_cpu``, the buffers' ``offload_to_cpu``: storage resized to 0, pinned CPU copies),
        not ``torch_memory_saver``: that pauses only memory allocated inside its regions (its LD_PRELOAD
        hook, or its allocator mode), i.e. every trainer allocation from start-up on, which nothing here
        has measured yet; the buffer moves are exact and measured by ``tests/test_megatron_gpu.py``."""
        if part == WEIGHTS:
            self.optimizer.move_weights(onto_device)
            return
        self.optimizer.move_training_state(onto_device)
        if self.ref_model is not None:
            self.ref_model.to(self.device if onto_device else "cpu")

    def _require_init(self) -> None:
        if self.model is None:
            raise RuntimeError("MegatronBackend.init() must run before train / compute_log_probs / save / weight sync")

