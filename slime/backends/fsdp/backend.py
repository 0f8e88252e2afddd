"""``--train-backend fsdp``: the Hugging Face model trained with GRPO under torch FSDP2.

One :class:`FSDPBackend` per rank; all ranks form one data-parallel group (gloo on CPU,
NCCL for CUDA tensors plus gloo for CPU tensors on GPU machines).  What a rollout's
:meth:`FSDPBackend.train` does, in order:

1. old log-probs: one no-grad forward pass of the current policy over all of this rank's
   samples (or the engines' rollout log-probs with ``--use-rollout-logprobs``, as upstream
   slime); reference log-probs likewise when a KL term needs them;
2. ``num_steps`` optimizer steps, each over one equal chunk of the samples, cut into
   micro-batches of ``--micro-batch-size``; each micro-batch's GRPO loss
   (:func:`slime.grpo.loss.grpo_micro_batch_loss`) is normalised by the step's global sample
   (or token) count and multiplied by the data-parallel size, so that the gradients summed
   over micro-batches and averaged by FSDP over ranks are those of the step's global mean;
3. per step: clip the global gradient norm (``--clip-grad``), AdamW step with the rate of
   :class:`slime.backends.lr_schedule.LRSchedule`, zero the gradients.

Precision: float32 master weights and optimizer state.  On GPU with ``--bf16`` the blocks
compute in bfloat16 and reduce gradients in float32 (FSDP2 ``MixedPrecisionPolicy``); on
CPU ``--bf16`` is ignored and everything runs in float32.  Log-probs and losses are always
float32.

Optimizer: AdamW (Loshchilov & Hutter 2019) with decoupled weight decay on matrices only;
biases, norm weights and other 1-D parameters get no decay (Megatron-LM's default).
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from slime.backends.base import WEIGHTS, RankInfo, TrainerBackend
from slime.backends.batching import (
    check_train_samples,
    loss_normalizer,
    pad_per_token,
    split_into_micro_batches,
    split_into_steps,
)
from slime.backends.config import CheckpointConfig, OptimizerConfig, TrainConfig
from slime.backends.fsdp.config import FSDPConfig, check_train
from slime.backends.fsdp.hf_io import (
    hf_checkpoint_folder,
    iter_hf_weight_buckets,
    iter_hf_weight_groups,
    load_sharded_model,
    save_hf_folder,
)
from slime.backends.fsdp.inputs import build_model_inputs, response_log_probs, vision_placeholder_ids
from slime.backends.lr_schedule import LRSchedule
from slime.backends.rng import rng_state, set_rng_state
from slime.backends.rounding import rounding_step_noise
from slime.backends.train_metrics import all_reduce_sums, logprob_gap_metrics, logprob_gap_sums
from slime.checkpoints import layout as ckpt
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig
from slime.grpo.loss import grpo_micro_batch_loss

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 << 30
"""Target size of one safetensors file of a saved ``model/`` folder (5 GiB, as ``save_pretrained``)."""


class FSDPBackend(TrainerBackend):
    """One rank of the FSDP2 trainer (see the module docstring). Every method is collective.

    Args:
        rank_info: this rank's place in the trainer world.
        train: BACKEND_ARGS (``micro_batch_size``, ``bf16``, ``use_rollout_logprobs``: the engines'
            log-probs as the PPO ratio's old log-probs instead of a trainer forward pass, in which
            case ``train/logprob_abs_diff*`` are not reported).
        fsdp: BACKEND_ARGS (fsdp): ``attn_implementation``, ``gradient_checkpointing``.
        optimizer: OPTIMIZER_ARGS (AdamW and the LR schedule).
        grpo: the GRPO loss flags; ``grpo.needs_ref_model`` decides the reference model.
        checkpoint: CKPT_ARGS (``hf_checkpoint``, ``load``, ``ref_load``, ``no_save_optim``,
            ``no_load_optim``).
        rollout_temperature: the engines' sampling temperature (``--rollout-temperature``, > 0,
            checked at parse time); log-probs are taken under ``softmax(logits / rollout_temperature)``.
        num_rollout: rollout steps of the run, or None when unknown (then a decaying LR
            schedule needs ``--lr-decay-iters``).
        num_steps_per_rollout: optimizer steps per rollout (samples per rollout /
            ``--global-batch-size``); with ``num_rollout`` it gives the default decay length.
        seed: base seed; rank ``r`` seeds torch with ``seed + r``.

    Raises:
        ConfigError: ``--use-dynamic-batch-size`` (see :func:`slime.backends.fsdp.config.check_train`;
            the Megatron backend's flags never reach this class), or an inconsistent LR schedule
            (see :class:`LRSchedule`).
        ValueError: ``num_steps_per_rollout < 1``.
    """

    def __init__(
        self,
        rank_info: RankInfo,
        *,
        train: TrainConfig,
        fsdp: FSDPConfig,
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
        check_train(train)  # also run at parse time (FSDPConfig.check)
        self.rank_info = rank_info
        self.train_cfg = train
        self.fsdp_cfg = fsdp
        self.optim_cfg = optimizer
        self.grpo = grpo
        self.ckpt_cfg = checkpoint
        self.temperature = rollout_temperature
        self.seed = seed
        total_steps = None if num_rollout is None else num_rollout * num_steps_per_rollout
        self.lr_schedule = LRSchedule.from_config(optimizer, total_steps)
        self.optimizer_steps = 0
        self.device = torch.device("cpu")
        self.compute_dtype = torch.float32
        self.mesh = None
        self.model = None
        self.ref_model = None
        self.optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def from_config(cls, cfg, rank_info: RankInfo) -> "FSDPBackend":
        """Build from the run's :class:`slime.arguments.SlimeConfig` (what the trainer group calls)."""
        return cls(
            rank_info,
            train=cfg.train,
            fsdp=cfg.fsdp,
            optimizer=cfg.optimizer,
            grpo=cfg.grpo,
            checkpoint=cfg.checkpoint,
            rollout_temperature=cfg.rollout.rollout_temperature,
            num_rollout=cfg.rollout.num_rollout,
            num_steps_per_rollout=max(1, cfg.rollout.samples_per_rollout // cfg.train.global_batch_size),
            seed=cfg.cluster.seed,
        )

    # ------------------------------------------------------------------------------------
    # init
    # ------------------------------------------------------------------------------------

    def init(self) -> int:
        """Join the process group, build the sharded policy, AdamW, the reference model (only when
        ``grpo.needs_ref_model``), and resume from ``--load`` when it holds a checkpoint.

        Returns:
            0 for a fresh run, ``k + 1`` after loading the checkpoint of rollout ``k``.

        Raises:
            FileNotFoundError: ``--hf-checkpoint`` / ``--ref-load`` is not a checkpoint folder.
            CheckpointError: ``--load`` is malformed or lacks the optimizer state to load.
            RuntimeError: a process group of another size or rank is already initialised.
        """
        self._init_process_group()
        self.mesh = init_device_mesh(self.device.type, (self.rank_info.world_size,), mesh_dim_names=("dp",))
        torch.manual_seed(self.seed + self.rank_info.rank)

        hf_folder = hf_checkpoint_folder(self.ckpt_cfg.hf_checkpoint, "--hf-checkpoint")
        load_root = self.ckpt_cfg.load
        resume_id = ckpt.latest_iteration(load_root) if load_root else None
        if load_root and resume_id is None:
            logger.info("--load %s holds no checkpoint yet; starting from --hf-checkpoint %s", load_root, hf_folder)
        weights = ckpt.model_dir(load_root, resume_id) if resume_id is not None else hf_folder

        self.model = load_sharded_model(
            weights,
            mesh=self.mesh,
            device=self.device,
            dtype=torch.float32,
            attn_implementation=self.fsdp_cfg.attn_implementation,
            gradient_checkpointing=self.fsdp_cfg.gradient_checkpointing,
            param_dtype=None if self.compute_dtype == torch.float32 else self.compute_dtype,
        )
        self.optimizer = self._build_optimizer()
        if self.grpo.needs_ref_model:
            self.ref_model = load_sharded_model(
                reference_weights(self.ckpt_cfg.ref_load, hf_folder),
                mesh=self.mesh,
                device=self.device,
                dtype=self.compute_dtype,
                attn_implementation=self.fsdp_cfg.attn_implementation,
                trainable=False,
            )
        if resume_id is None:
            return 0
        self._load_trainer_state(ckpt.trainer_dir(load_root, resume_id))
        logger.info("resumed from %s (rollout %d, %d optimizer steps)", load_root, resume_id, self.optimizer_steps)
        return resume_id + 1

    def _init_process_group(self) -> None:
        """Join (or reuse) the default process group; pick the device and compute dtype."""
        info = self.rank_info
        if info.device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", info.rank % torch.cuda.device_count()))
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            self.compute_dtype = torch.bfloat16 if self.train_cfg.bf16 else torch.float32
        elif self.train_cfg.bf16:
            logger.info("--bf16 applies to GPU runs only; training on CPU in float32")
        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
                raise RuntimeError(
                    f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already exists, "
                    f"but this backend is rank {info.rank} of {info.world_size}"
                )
            return
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if info.device == "cuda" else "gloo",
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
        )

    def _build_optimizer(self) -> torch.optim.AdamW:
        """AdamW over the policy's parameters: weight decay on tensors of >= 2 dims only (Megatron's rule)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        cfg = self.optim_cfg
        return torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=self.lr_schedule(self.optimizer_steps),
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )

    # ------------------------------------------------------------------------------------
    # log-probs and training
    # ------------------------------------------------------------------------------------

    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False) -> list[list[float]]:
        """Per-token log-probs (nats) of each response under the current policy at
        ``--rollout-temperature`` (no grad). Every rank must pass the same number of samples.
        ``rounding_noise``: see :meth:`TrainerBackend.compute_log_probs`.

        Raises:
            SampleError: a malformed sample on any rank (see :func:`check_train_samples`).
        """
        self._require_init()
        self._require_on_device("compute_log_probs()", training=False)
        check_train_samples(samples)
        with rounding_step_noise(self.model.get_input_embeddings() if rounding_noise else None):
            return [lp.tolist() for lp in self._log_probs(self.model, samples)]

    def _log_probs(self, model, samples: Sequence[Sample]) -> list[Tensor]:
        """No-grad log-probs of each sample's response, float32 ``[R]`` on CPU, in micro-batches."""
        was_training = model.training
        model.eval()
        out = []
        with torch.no_grad():
            for micro in split_into_micro_batches(samples, self.train_cfg.micro_batch_size):
                inputs = build_model_inputs(micro, model.config, self.device)
                log_probs, _ = response_log_probs(model, inputs, self.temperature)
                out.extend(log_probs[b, : s.response_length].float().cpu() for b, s in enumerate(micro))
        # FSDP2 keeps the root's parameters gathered after a forward, expecting a backward;
        # free them (and put the sharded master weights back in place for save / weight sync).
        model.reshard()
        model.train(was_training)
        return out

    def train(self, rollout_id: int, samples: list[Sample], num_steps: int) -> dict[str, float]:
        """``num_steps`` optimizer steps over this rank's samples; see the module docstring.

        Returns:
            Metrics averaged over the steps, identical on every rank: ``train/loss``,
            ``train/pg_loss``, ``train/pg_clipfrac``, ``train/ppo_kl``, ``train/entropy``,
            ``train/kl_loss`` (with ``--use-kl-loss``), ``train/grad_norm`` (before clipping),
            ``train/lr``, and (unless ``--use-rollout-logprobs``) ``train/logprob_abs_diff``
            with ``_image`` / ``_text`` splits, a split being omitted when it has no sample; colocated on
            GPU this rank's free memory around the offloads / onloads since the last ``train``
            (``perf/{train,resync}_free_gib_*``, :meth:`TrainerBackend.memory_metrics`).

        Raises:
            SampleError: a malformed sample on any rank, or a missing ``rollout_log_probs``
                with ``--use-rollout-logprobs`` (see :func:`check_train_samples`).
            ValueError: ``len(samples)`` is not a positive multiple of ``num_steps``.
            FloatingPointError: the gradient norm is not finite.
            RuntimeError: the optimizer state is offloaded (no :meth:`onload` after :meth:`offload`).
        """
        self._require_init()
        self._require_on_device("train()", training=True)
        check_train_samples(samples, need_rollout_log_probs=self.train_cfg.use_rollout_logprobs)
        steps = split_into_steps(range(len(samples)), num_steps)
        old_log_probs = self._old_log_probs(samples)
        ref_log_probs = self._log_probs(self.ref_model, samples) if self.ref_model is not None else None

        self.model.train()
        totals: dict[str, float] = defaultdict(float)
        for indices in steps:
            step_metrics = self._optimizer_step(
                rollout_id,
                [samples[i] for i in indices],
                [old_log_probs[i] for i in indices],
                None if ref_log_probs is None else [ref_log_probs[i] for i in indices],
            )
            for name, value in step_metrics.items():
                totals[name] += value
        metrics = {name: value / num_steps for name, value in totals.items()}
        if not self.train_cfg.use_rollout_logprobs:
            gap = logprob_gap_sums(samples, old_log_probs, vision_placeholder_ids(self.model.config))
            metrics.update(logprob_gap_metrics(all_reduce_sums(gap)))
        metrics.update(self.memory_metrics())
        return metrics

    def _old_log_probs(self, samples: Sequence[Sample]) -> list[Tensor]:
        """The PPO ratio's denominators: the rollout's log-probs, or a trainer forward pass."""
        if not self.train_cfg.use_rollout_logprobs:
            return self._log_probs(self.model, samples)
        return [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]

    def _optimizer_step(
        self,
        rollout_id: int,
        samples: list[Sample],
        old_log_probs: list[Tensor],
        ref_log_probs: list[Tensor] | None,
    ) -> dict[str, float]:
        """One optimizer step over this rank's share of the step; returns its reduced metrics."""
        normalizer = loss_normalizer(samples, per_token=self.grpo.calculate_per_token_loss)
        lr = self.lr_schedule(self.optimizer_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        sums: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        indices = list(range(len(samples)))
        for micro in split_into_micro_batches(indices, self.train_cfg.micro_batch_size):
            loss, terms = self._micro_batch_loss(
                [samples[i] for i in micro],
                [old_log_probs[i] for i in micro],
                None if ref_log_probs is None else [ref_log_probs[i] for i in micro],
                normalizer,
            )
            (loss * self.rank_info.world_size).backward()
            sums["train/loss"] += loss.detach().double().cpu()
            for name, value in terms.items():
                sums[f"train/{name}"] += value.double().cpu()

        grad_norm = self._clip_grad_norm(rollout_id)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return {**all_reduce_sums(sums), "train/grad_norm": grad_norm, "train/lr": lr}

    def _micro_batch_loss(
        self,
        samples: list[Sample],
        old_log_probs: list[Tensor],
        ref_log_probs: list[Tensor] | None,
        normalizer: float,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """This micro-batch's share of the step's GRPO loss (differentiable) and metric terms."""
        inputs = build_model_inputs(samples, self.model.config, self.device)
        log_probs, entropy = response_log_probs(
            self.model, inputs, self.temperature, with_entropy=True, entropy_grad=self.grpo.entropy_coef != 0
        )
        loss_mask = pad_per_token([s.loss_mask for s in samples], torch.float32, self.device)
        old = pad_per_token(old_log_probs, torch.float32, self.device)
        ref = None if ref_log_probs is None else pad_per_token(ref_log_probs, torch.float32, self.device)
        advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=self.device)
        return grpo_micro_batch_loss(
            log_probs,
            old,
            advantages,
            loss_mask,
            self.grpo,
            global_normalizer=normalizer,
            ref_log_probs=ref,
            entropy=entropy,
        )

    def _clip_grad_norm(self, rollout_id: int) -> float:
        """Global L2 norm of all gradients (before clipping); clip to ``--clip-grad`` when > 0.

        Raises:
            FloatingPointError: the norm is NaN or infinite (identical on every rank).
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if not torch.isfinite(norm):
            raise FloatingPointError(
                f"rollout {rollout_id}, optimizer step {self.optimizer_steps}: gradient norm is {norm.item()}; "
                "lower --lr, check the rewards/advantages for NaN, or train in float32 (--no-bf16)"
            )
        if self.optim_cfg.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.optim_cfg.clip_grad, norm)
        return float(norm)

    # ------------------------------------------------------------------------------------
    # weights out, checkpoints
    # ------------------------------------------------------------------------------------

    def iter_weight_buckets(
        self, bucket_bytes: int, device: str | torch.device | None = None
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """This rank's share of the full weights by checkpoint (safetensors) name, in lockstep buckets.

        The FSDP units are packed into rounds of about ``bucket_bytes`` and round ``k`` is sent by
        rank ``k % world_size`` (:func:`slime.backends.fsdp.hf_io.iter_hf_weight_buckets`): all
        ranks gather every unit, each keeps the rounds it is the source of and yields ``[]`` for
        the others.  A bucket holds whole FSDP units (a decoder layer with all its experts, a
        vision block, or the root's parameters).  Tensors are in the compute dtype (bfloat16 with
        ``--bf16`` on GPU, else float32), on ``device`` (default: this rank's device).
        """
        self._require_init()
        self._require_on_device("iter_weight_buckets()", training=False)
        yield from iter_hf_weight_buckets(self.model, self.compute_dtype, bucket_bytes, device=device or self.device)

    def save(self, rollout_id: int, path: Path) -> None:
        """Write ``path/model`` (HF folder) and ``path/trainer`` (optimizer, scheduler, RNG). Collective.

        - ``model/``: float32 master weights as sharded safetensors with checkpoint names
          (:func:`slime.backends.fsdp.hf_io.save_hf_folder`), plus ``config.json``, the
          tokenizer, chat template and processor files copied from ``--hf-checkpoint``;
          loadable by ``from_pretrained`` and usable as ``--hf-checkpoint``.  ``config.json``
          keeps the source's ``dtype``, so engines load it in their usual precision.
        - ``trainer/optimizer/``: AdamW state as a ``torch.distributed.checkpoint`` (sharded,
          reloadable at another world size); skipped with ``--no-save-optim``.
        - ``trainer/scheduler.pt``: ``{"optimizer_steps": n}`` (the LR schedule's position).
        - ``trainer/rng_rank<r>.pt``: rank ``r``'s torch / CUDA / Python / NumPy RNG states.

        ``path`` is the iteration folder (``slime.checkpoints.layout.iteration_dir``); an
        existing ``model/`` or ``trainer/`` in it is replaced.
        """
        self._require_init()
        path = Path(path)
        model_out, trainer_out = path / "model", path / "trainer"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(trainer_out, ignore_errors=True)
            trainer_out.mkdir(parents=True)
        dist.barrier()

        groups = iter_hf_weight_groups(self.model, torch.float32)
        if rank == 0:
            save_hf_folder(groups, model_out, self.ckpt_cfg.hf_checkpoint, MAX_SHARD_BYTES)
        else:
            collections.deque(groups, maxlen=0)  # take part in the gathers; only rank 0 receives groups
        if not self.ckpt_cfg.no_save_optim:
            optimizer_state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.save(optimizer_state, checkpoint_id=trainer_out / "optimizer")
        if rank == 0:
            torch.save({"optimizer_steps": self.optimizer_steps}, trainer_out / "scheduler.pt")
        torch.save(rng_state(), trainer_out / f"rng_rank{rank:05d}.pt")
        dist.barrier()

    def _load_trainer_state(self, trainer_dir: Path) -> None:
        """Restore optimizer + scheduler state (unless ``--no-load-optim``) and this rank's RNG.

        Raises:
            CheckpointError: the optimizer state or scheduler file is missing; the message
                says to resume with ``--no-load-optim``.
        """
        if not self.ckpt_cfg.no_load_optim:
            optim_dir, sched_file = trainer_dir / "optimizer", trainer_dir / "scheduler.pt"
            for needed in (optim_dir, sched_file):
                if not needed.exists():
                    raise ckpt.CheckpointError(
                        f"{needed} is missing (saved with --no-save-optim?); resume with --no-load-optim "
                        "to start AdamW and the LR schedule afresh"
                    )
            state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(state, checkpoint_id=optim_dir)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            self.optimizer_steps = int(torch.load(sched_file)["optimizer_steps"])
        rng_file = trainer_dir / f"rng_rank{dist.get_rank():05d}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            logger.warning("%s is missing (saved with fewer ranks?); this rank keeps its fresh RNG state", rng_file)

    # ------------------------------------------------------------------------------------
    # colocated memory
    # ------------------------------------------------------------------------------------

    def _move_part(self, part: str, onto_device: bool) -> None:
        """Colocated offload (:meth:`TrainerBackend.offload` / :meth:`~TrainerBackend.onload` decide what and
        when): :data:`WEIGHTS` is the policy's FSDP shards (``model.to``: the parameter objects stay, so the
        optimizer keeps stepping them); :data:`TRAINING_STATE` the AdamW state tensors and the reference
        model's shards.  Gradients need no move: ``zero_grad(set_to_none=True)`` frees them after each
        optimizer step."""
        device = self.device if onto_device else torch.device("cpu")
        if part == WEIGHTS:
            self.model.to(device)
            return
        if self.ref_model is not None:
            self.ref_model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    state[key] = value.to(device, non_blocking=True)

    def _require_init(self) -> None:
        if self.model is None:
            raise RuntimeError("FSDPBackend.init() must run before train / compute_log_probs / save / weight sync")


def reference_weights(ref_load: str | None, hf_checkpoint: Path) -> Path:
    """The folder the reference model is loaded from.

    Args:
        ref_load: ``--ref-load``: a slime checkpoint root (its latest complete checkpoint's
            ``model/`` is used) or a Hugging Face checkpoint folder; None for the default.
        hf_checkpoint: ``--hf-checkpoint`` (the initial policy weights), the default.

    Raises:
        FileNotFoundError: ``ref_load`` is neither a slime checkpoint root nor an HF folder.
        CheckpointError: ``ref_load``'s latest-checkpoint marker is malformed.
    """
    if ref_load is None:
        return Path(hf_checkpoint)
    latest = ckpt.latest_iteration(ref_load)
    if latest is not None:
        return ckpt.model_dir(ref_load, latest)
    return hf_checkpoint_folder(ref_load, "--ref-load")

