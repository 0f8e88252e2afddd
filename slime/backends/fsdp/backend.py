"""``--train-backend fsdp``: the Hugging Face model trained with GRPO under torch FSDP2.

One :class:`FSDPBackend` per rank, all ranks one data-parallel group (gloo on CPU; NCCL plus gloo for CPU tensors on
GPU machines).  It is the training step's backend (:class:`slime.backends.step.StepBackend`): padded micro-batches
(below), each micro-batch's loss times the data-parallel size before its backward (FSDP averages gradients
over ranks), the global norm of the sharded gradients, AdamW (decay on matrices only).  Precision:
float32 master weights and optimizer state; ``--bf16`` on GPU computes the blocks in bfloat16 and reduces gradients
in float32 (ignored on CPU); log-probs and losses in float32.

A micro-batch (:func:`build_model_inputs`) is right-padded ``[B, T]`` rows, row ``b`` = ``prompt_token_ids +
response_token_ids`` of sample ``b``.  The logit at ``t`` predicts token ``t + 1``, so the response (positions ``P ..
P+R-1``) is predicted at ``P-1 .. P+R-2``; only the positions from the first sample's ``P-1`` to the last response
token reach the LM head (``logits_to_keep``).  Images are concatenated in sample order and ``mm_token_type_ids`` marks image tokens; a micro-batch without images gets one
blank image after row 0 (why: ``docs/design/training_step.md``); generated placeholders are fed as
:data:`~slime.backends.samples.PAD_TOKEN_ID`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import ClassVar, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion

from slime.backends.config import RankInfo, TrainerSpec
from slime.backends.freeze import freeze_policy, frozen_change, write_frozen
from slime.backends.fsdp.config import FSDPConfig, check_train
from slime.backends.fsdp.hf_io import iter_hf_weight_buckets, iter_hf_weight_groups, load_sharded_model, save_hf_folder
from slime.backends.fsdp.parallelize import reshard_all
from slime.backends.handover import WEIGHTS, HandOver
from slime.backends.rng import rng_state, set_rng_state
from slime.backends.samples import PAD_TOKEN_ID, model_input_ids
from slime.backends.step import FORWARD_LOG_PROBS, MicroBatch, compute_log_probs
from slime.backends.train_metrics import DataParallel
from slime.backends.weight_sources import WeightSource, resolve_weights
from slime.checkpoints import layout as ckpt
from slime.data.processor import mm_token_type_ids
from slime.data.sample import Sample
from slime.grpo.log_probs import full_vocab_log_probs
from slime.grpo.loss import grpo_micro_batch_loss
from slime.routing_replay import RouteError, RouteShape, hf_padded_routes

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 << 30
"""Target size of one safetensors file of a saved ``model/`` folder (5 GiB, as ``save_pretrained``)."""


class FSDPBackend:
    """One rank of the FSDP2 trainer (module docstring); every public method is collective.  ``spec``: the flag groups
    every rank gets; ``config``: its BACKEND_ARGS (``attn_implementation``, ``gradient_checkpointing``).

    Attributes (besides :class:`~slime.backends.step.StepBackend`'s, set by :meth:`init`):
        frozen: this rank's frozen policy parameters, by in-memory name (``--freeze-params-name-list``).
        frozen_hf_names: the checkpoint names of every frozen tensor over all ranks (the weight sync sends them once).

    Raises:
        ConfigError: ``--use-dynamic-batch-size`` (:func:`slime.backends.fsdp.config.check_train`).
    """

    flag_group: ClassVar[str] = "fsdp"
    """Its own flag group in the run's config (:meth:`slime.arguments.SlimeConfig.backend_config`)."""

    def __init__(self, rank_info: RankInfo, spec: TrainerSpec, config: FSDPConfig):
        check_train(spec.train)  # also run at parse time (FSDPConfig.check)
        self.rank_info, self.spec, self.fsdp_cfg = rank_info, spec, config
        self.compute_dtype = torch.float32
        self.mesh = None
        self.device = torch.device("cpu")
        self.model = self.ref_model = self.optimizer = None  # the rest of the step's attributes: init()
        self.memory = HandOver(self)
        self.frozen = self.frozen_hf_names = frozenset()

    # ------------------------------------------------------------------------------------
    # init
    # ------------------------------------------------------------------------------------

    def init(self) -> int:
        """Join the process group; build the sharded policy, AdamW and (with a KL term) the reference model from
        :func:`~slime.backends.weight_sources.resolve_weights`; resume when ``--load`` holds a checkpoint.  Returns the
        next rollout id.

        Raises:
            CheckpointError: a weight flag's folder is not what it must be, or the optimizer state to load is missing.
            RuntimeError: a process group of another size or rank is already initialised.
        """
        self.optimizer_steps = 0
        self._init_process_group()
        self.mesh = init_device_mesh(self.device.type, (self.rank_info.world_size,), mesh_dim_names=("dp",))
        self.dp = DataParallel(dist.get_rank(), dist.get_world_size())
        torch.manual_seed(self.spec.seed + self.rank_info.rank)

        start = resolve_weights(self.spec.checkpoint, need_reference=self.spec.grpo.needs_ref_model)
        self.model = load_sharded_model(
            _hf_folder(start.policy),
            mesh=self.mesh,
            device=self.device,
            dtype=torch.float32,
            attn_implementation=self.fsdp_cfg.attn_implementation,
            gradient_checkpointing=self.fsdp_cfg.gradient_checkpointing,
            param_dtype=None if self.compute_dtype == torch.float32 else self.compute_dtype,
        )
        self.placeholder_ids = vision_placeholder_ids(self.model.config)
        try:  # the policy's routed experts (raised by route_shape() where it cannot replay them)
            self._route_shape = RouteShape.from_hf_config(self.model.config.to_dict(), "the policy's config") or \
                NotImplementedError("the policy has no MoE layers: there are no routed experts to replay")
        except RouteError as e:
            self._route_shape = e
        self.frozen, self.frozen_hf_names = freeze_policy(self.model, self.spec.train, self._hf_names_by_param,
                                                          self.device)
        self.optimizer = self._build_optimizer()
        if start.reference is not None:
            self.ref_model = load_sharded_model(
                _hf_folder(start.reference),
                mesh=self.mesh,
                device=self.device,
                dtype=self.compute_dtype,
                attn_implementation=self.fsdp_cfg.attn_implementation,
                trainable=False,
            )
        resume_id = start.policy.rollout_id
        if resume_id is None:
            return 0
        self._load_trainer_state(ckpt.trainer_dir(start.policy.path, resume_id))
        logger.info("resumed from %s (%d optimizer steps)", start.policy, self.optimizer_steps)
        return start.next_rollout_id

    def _init_process_group(self) -> None:
        """Join (or reuse) the default process group; pick the device and compute dtype."""
        info = self.rank_info
        if info.device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", info.rank % torch.cuda.device_count()))
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            self.compute_dtype = torch.bfloat16 if self.spec.train.bf16 else torch.float32
        elif self.spec.train.bf16:
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
        cfg = self.spec.optimizer
        return torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=self.spec.lr_schedule(self.optimizer_steps),
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
        )

    # ------------------------------------------------------------------------------------
    # the training step's backend (slime.backends.step.StepBackend)
    # ------------------------------------------------------------------------------------

    def pack(self, samples: list[Sample]) -> None:
        """Nothing: the padded layout is built from the samples in each forward (:func:`.inputs.build_model_inputs`)."""
        return None

    def log_probs(self, model, batches: list[MicroBatch], *, replay_routes: bool = False,
                  capture_routes: bool = False) -> list[Tensor]:
        """No-grad log-probs of each sample's response, float32 ``[R]`` on CPU, one padded micro-batch at a time;
        with ``replay_routes`` the HF routers take ``batch.routes``, with ``capture_routes`` their choices go to
        ``batch.trainer_routes`` (:func:`slime.routing_replay.hf_padded_routes`)."""
        was_training = model.training
        model.eval()
        out = []
        shape = self.route_shape() if replay_routes or capture_routes else None
        with torch.no_grad():
            for batch in batches:
                inputs = build_model_inputs(batch.samples, model.config, self.device)
                width = inputs.model_kwargs["input_ids"].shape[1]
                with hf_padded_routes(model, batch, width, shape, replay=replay_routes, capture=capture_routes,
                                      device=self.device):
                    log_probs, _ = response_log_probs(model, inputs, self.spec.rollout_temperature)
                out.extend(log_probs[b, : s.response_length].float().cpu() for b, s in enumerate(batch.samples))
        # FSDP2 keeps the root's parameters (on CPU every unit's) gathered after a forward, expecting a backward;
        # free them (and put the sharded master weights back in place for save / weight sync).
        reshard_all(model)
        model.train(was_training)
        return out

    def route_shape(self) -> RouteShape:
        """The policy's routed experts per position (its config's, read in ``init``); NotImplementedError for a dense
        policy, RouteError for one with more experts than uint8 routes name."""
        if isinstance(self._route_shape, Exception):
            raise self._route_shape
        return self._route_shape

    def forward_backward(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        """Each micro-batch's share of the step's GRPO loss, times the world size before its backward (FSDP
        averages the gradients over the ranks).  On CPU the gradients add up unsharded on each rank and are
        reduce-scattered once, in the step's last backward (on GPU after every micro-batch, keeping one shard's
        memory): the same sum in another rounding order, one collective per unit and step instead of per micro-batch."""
        try:
            return self._micro_batch_backwards(batches, normalizer)
        finally:
            self.model.set_requires_gradient_sync(True)
            self.model.set_reshard_after_backward(True)

    def _micro_batch_backwards(self, batches: list[MicroBatch], normalizer: float) -> list[dict[str, Tensor]]:
        out = []
        grpo = self.spec.grpo
        for i, batch in enumerate(batches):
            if self.device.type == "cpu":
                last = i == len(batches) - 1
                self.model.set_requires_gradient_sync(last)
                self.model.set_reshard_after_backward(last)
            samples = batch.samples
            inputs = build_model_inputs(samples, self.model.config, self.device)
            # the backward inside too: activation checkpointing reruns the routers there
            replay = batch.routes is not None
            shape = self.route_shape() if replay else None
            with hf_padded_routes(self.model, batch, inputs.model_kwargs["input_ids"].shape[1], shape, replay=replay,
                                  capture=False, device=self.device):
                log_probs, entropy = response_log_probs(
                    self.model, inputs, self.spec.rollout_temperature, with_entropy=True,
                    entropy_grad=grpo.entropy_coef != 0)
                loss, terms = grpo_micro_batch_loss(
                    log_probs,
                    None if batch.old_log_probs is None else pad_per_token(batch.old_log_probs, torch.float32,
                                                                           self.device),
                    torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=self.device),
                    pad_per_token([s.loss_mask for s in samples], torch.float32, self.device),
                    grpo,
                    global_normalizer=normalizer,
                    ref_log_probs=None if batch.ref_log_probs is None else pad_per_token(
                        batch.ref_log_probs, torch.float32, self.device),
                    rollout_log_probs=None if batch.rollout_log_probs is None else pad_per_token(
                        batch.rollout_log_probs, torch.float32, self.device),
                    entropy=entropy,
                    advantage_whitening=batch.advantage_whitening,
                )
                (loss * self.rank_info.world_size).backward()
            out.append({"loss": loss.detach(), **terms})
            if batch.old_log_probs is None:  # --skip-actor-forward-only: this forward's are the old ones
                out[-1][FORWARD_LOG_PROBS] = [log_probs[b, : s.response_length].detach().float()
                                              for b, s in enumerate(samples)]
        for terms in out:  # to the host once the step's backwards are queued
            if FORWARD_LOG_PROBS in terms:
                terms[FORWARD_LOG_PROBS] = [t.cpu() for t in terms[FORWARD_LOG_PROBS]]
        return out

    def grad_norm(self) -> float:
        """Global L2 norm of all gradients (the shards' norms combined over the ranks)."""
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def apply_update(self, lr: float, grad_scale: float) -> dict[str, float]:
        """Scale the gradients, AdamW at ``lr``, then free the gradients (``zero_grad(set_to_none=True)``); no metrics
        of its own."""
        if grad_scale < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {}

    def input_embedding(self) -> torch.nn.Module:
        """The policy's token embedding (every rank holds its shard)."""
        return self.model.get_input_embeddings()

    def compute_log_probs(self, samples: list[Sample], *, rounding_noise: bool = False,
                          replay_routes: bool = False) -> list[list[float]]:
        """:func:`slime.backends.step.compute_log_probs` (every rank computes every sample's)."""
        return compute_log_probs(self, samples, rounding_noise=rounding_noise, replay_routes=replay_routes)

    # ------------------------------------------------------------------------------------
    # weights out, checkpoints
    # ------------------------------------------------------------------------------------

    def iter_weight_buckets(
        self, bucket_bytes: int, device: str | torch.device | None = None, skip_frozen: bool = False
    ) -> Iterator[list[tuple[str, Tensor]]]:
        """This rank's share of the weights by checkpoint name in the compute dtype on ``device``
        (:func:`slime.backends.fsdp.hf_io.iter_hf_weight_buckets`: whole FSDP units, round ``k`` from rank ``k %
        world``); ``skip_frozen``: the frozen parameters are neither gathered nor sent."""
        self.memory.require("iter_weight_buckets()", training=False)
        yield from iter_hf_weight_buckets(self.model, self.compute_dtype, bucket_bytes, device=device or self.device,
                                          skip=self.frozen if skip_frozen else frozenset())

    def _hf_names_by_param(self) -> dict[str, list[str]]:
        """Each parameter's checkpoint names: ``revert_weight_conversion`` of a meta tensor of its global shape."""
        return {name: list(revert_weight_conversion(self.model, {name: torch.empty(p.shape, device="meta")}))
                for name, p in self.model.named_parameters()}

    def save(self, rollout_id: int, path: Path) -> None:
        """Write ``path/model`` and ``path/trainer``, replacing them. Collective.

        - ``model/``: the float32 master weights as a Hugging Face folder (:func:`.hf_io.save_hf_folder`), usable as
          ``--hf-checkpoint`` (``config.json`` keeps the source's ``dtype``);
        - ``trainer/optimizer/``: AdamW's state, a ``torch.distributed.checkpoint`` (reloadable at another world size;
          not with ``--no-save-optim``); ``trainer/scheduler.pt``: ``{"optimizer_steps": n}``;
          ``trainer/rng_rank<r>.pt``: rank ``r``'s torch / CUDA / Python / NumPy RNG states;
          ``trainer/frozen_params.json``: the frozen checkpoint names (:mod:`slime.backends.freeze`).
        """
        self.memory.require_init()
        path = Path(path)
        model_out, trainer_out = path / "model", path / "trainer"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(trainer_out, ignore_errors=True)
            trainer_out.mkdir(parents=True)
        dist.barrier()

        groups = iter_hf_weight_groups(self.model, torch.float32)
        if rank == 0:
            save_hf_folder(groups, model_out, self.spec.checkpoint.hf_checkpoint, MAX_SHARD_BYTES)
        else:
            collections.deque(groups, maxlen=0)  # take part in the gathers; only rank 0 receives groups
        if not self.spec.checkpoint.no_save_optim:
            optimizer_state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            try:
                dcp.save(optimizer_state, checkpoint_id=trainer_out / "optimizer")
            except Exception as err:  # a full disk reads as an unexplained zip-writer error: say so when it is one
                raise ckpt.explain_write_failure(trainer_out, state_bytes(optimizer_state), err)
        if rank == 0:
            torch.save({"optimizer_steps": self.optimizer_steps}, trainer_out / "scheduler.pt")
            write_frozen(trainer_out, set(self.frozen_hf_names))
        torch.save(rng_state(), trainer_out / f"rng_rank{rank:05d}.pt")
        dist.barrier()

    def _load_trainer_state(self, trainer_dir: Path) -> None:
        """Restore optimizer and scheduler state (unless ``--no-load-optim``) and this rank's RNG.

        Raises:
            CheckpointError: the optimizer state or scheduler file is missing (the message says ``--no-load-optim``).
        """
        if not self.spec.checkpoint.no_load_optim:
            optim_dir, sched_file = trainer_dir / "optimizer", trainer_dir / "scheduler.pt"
            for needed in (optim_dir, sched_file):
                if not needed.exists():
                    raise ckpt.CheckpointError(
                        f"{needed} is missing (saved with --no-save-optim?); resume with --no-load-optim "
                        "to start AdamW and the LR schedule afresh"
                    )
            newly_frozen, newly_trained = frozen_change(trainer_dir, set(self.frozen_hf_names))
            state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            if newly_trained or newly_frozen:
                # frozen then, trained now: not in the checkpoint (partial load), state reset below; trained then,
                # frozen now: in the checkpoint, not asked for.  This run's param groups replace the saved ones.
                groups = copy.deepcopy(state["optimizer"]["param_groups"])
                dcp.load(state, checkpoint_id=optim_dir, planner=DefaultLoadPlanner(allow_partial_load=True))
                state["optimizer"]["param_groups"] = groups
            else:
                dcp.load(state, checkpoint_id=optim_dir)
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            if newly_trained:
                names = self._hf_names_by_param()
                for name, param in self.model.named_parameters():
                    if param.requires_grad and newly_trained.intersection(names[name]):
                        self.optimizer.state.pop(param, None)  # AdamW starts it at its first step: zeros, step 0
            self.optimizer_steps = int(torch.load(sched_file)["optimizer_steps"])
        rng_file = trainer_dir / f"rng_rank{dist.get_rank():05d}.pt"
        if rng_file.exists():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            logger.warning("%s is missing (saved with fewer ranks?); this rank keeps its fresh RNG state", rng_file)

    # ------------------------------------------------------------------------------------
    # colocated memory
    # ------------------------------------------------------------------------------------

    def move_part(self, part: str, onto_device: bool) -> None:
        """:data:`WEIGHTS`: the policy's shards (``model.to``, so the optimizer keeps its parameter objects);
        :data:`TRAINING_STATE`: AdamW's state and the reference model (gradients are freed after every step)."""
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


def _hf_folder(source: WeightSource) -> Path:
    """The Hugging Face folder of ``source``: itself, or a checkpoint's ``model/`` (this backend's layout)."""
    return source.path if source.rollout_id is None else ckpt.model_dir(source.path, source.rollout_id)


def state_bytes(state) -> int:
    """Bytes of this rank's tensors in a (nested) state dict; a DTensor counts its local shard."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, Tensor) else 0


# ------------------------------------------------------------------------------------
# padded micro-batches (module docstring)
# ------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelInputs:
    """A micro-batch ready for ``model(**model_kwargs)``.

    Attributes:
        model_kwargs: int64 ``input_ids`` ``[B, T]``, ``attention_mask`` ``[B, T]`` (only when ``B > 1``) and
            ``logits_to_keep`` ``[K]``; for a vision-language model also float32 ``pixel_values`` ``[patches,
            C*T*P*P]``, int64 ``image_grid_thw`` ``[images, 3]`` and ``mm_token_type_ids`` ``[B, T]``.
        response_index: int64 ``[B, R_max]``, the kept logit that predicts each response token (0 on padding).
        response_tokens: int64 ``[B, R_max]``, the response token ids (0 on padding).
    """

    model_kwargs: dict[str, Tensor]
    response_index: Tensor
    response_tokens: Tensor


def dummy_image(vision_config) -> tuple[Tensor, Tensor]:
    """A blank image of one merged token: ``(pixel_values [m*m, C*T*P*P] zeros, image_grid_thw [[1, m, m]])``,
    ``m`` the spatial merge size, ``C, T, P`` channels, temporal patch and patch size of ``vision_config``."""
    m = vision_config.spatial_merge_size
    patch_dim = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    return torch.zeros(m * m, patch_dim), torch.tensor([[1, m, m]], dtype=torch.int64)


def build_model_inputs(samples: Sequence[Sample], config, device: torch.device | str) -> ModelInputs:
    """Pad checked ``samples`` into one micro-batch for a Hugging Face causal (vision-)language model with ``config``
    (``vision_config``, ``image_token_id``, ``video_token_id`` mark a vision-language model), on ``device``.

    Raises:
        ValueError: a sample with ``pixel_values`` but no ``image_grid_thw``, or the reverse.
    """
    placeholders = vision_placeholder_ids(config)
    rows = [model_input_ids(s, placeholders) for s in samples]
    prompt_lens = [len(s.prompt_token_ids) for s in samples]
    response_lens = [s.response_length for s in samples]
    model_kwargs: dict[str, Tensor] = {}

    if getattr(config, "vision_config", None) is not None:
        pixel_values, grids = [], []
        for s in samples:
            mm = s.multimodal_inputs
            if "pixel_values" in mm:
                pixel_values.append(mm["pixel_values"])
                grids.append(mm["image_grid_thw"])
        if not pixel_values:
            pixels, grid = dummy_image(config.vision_config)
            pixel_values, grids = [pixels], [grid]
            rows[0] = rows[0] + [config.image_token_id]
        model_kwargs["pixel_values"] = torch.cat(pixel_values).to(device=device, dtype=torch.float32)
        model_kwargs["image_grid_thw"] = torch.cat(grids).to(device=device, dtype=torch.int64)

    input_ids = pad_per_token(rows, torch.int64, device, pad=PAD_TOKEN_ID)
    attention_mask = pad_per_token([[1] * len(row) for row in rows], torch.int64, device)
    model_kwargs["input_ids"] = input_ids
    if len(rows) > 1:
        model_kwargs["attention_mask"] = attention_mask
    if "pixel_values" in model_kwargs:
        model_kwargs["mm_token_type_ids"] = mm_token_type_ids(
            input_ids, config.image_token_id, getattr(config, "video_token_id", None)
        ) * attention_mask

    first = min(p - 1 for p in prompt_lens)
    last = max(p + r - 1 for p, r in zip(prompt_lens, response_lens))
    model_kwargs["logits_to_keep"] = torch.arange(first, last, device=device)
    response_index = pad_per_token(
        [range(p - 1 - first, p - 1 - first + r) for p, r in zip(prompt_lens, response_lens)], torch.int64, device
    )
    return ModelInputs(
        model_kwargs=model_kwargs,
        response_index=response_index,
        response_tokens=pad_per_token([s.response_token_ids for s in samples], torch.int64, device),
    )


def pad_per_token(rows: Sequence[Sequence[float] | Tensor], dtype: torch.dtype, device=None, pad: float = 0) -> Tensor:
    """Right-pad B per-token rows (lists or 1-D tensors) into one ``[B, max_len]`` tensor of ``dtype`` on ``device``,
    padding with ``pad`` (``max_len = 0`` when every row is empty)."""
    max_len = max((len(row) for row in rows), default=0)
    out = torch.full((len(rows), max_len), pad, dtype=dtype, device=device)
    for b, row in enumerate(rows):
        if len(row):
            out[b, : len(row)] = torch.as_tensor(row, dtype=dtype, device=device)
    return out


def vision_placeholder_ids(config) -> set[int]:
    """The model's image / video placeholder ids (``image_token_id``, ``video_token_id``); empty for text models."""
    return {getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)} - {None}


def response_log_probs(
    model: nn.Module, inputs: ModelInputs, temperature: float, *, with_entropy: bool = False, entropy_grad: bool = True
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and with ``with_entropy`` entropies, nats) of the response tokens under ``softmax(logits /
    temperature)`` (:func:`slime.grpo.log_probs.full_vocab_log_probs`),
    differentiable in grad mode; ``entropy_grad`` False computes the entropy without autograd (a metric only).
    ``model`` takes ``logits_to_keep`` (plain or FSDP-sharded).

    Returns:
        ``(log_probs, entropy)``: float32 ``[B, R_max]`` each, row ``b`` valid in its first ``R_b`` entries;
        ``entropy`` is None unless asked for.
    """
    logits = model(**inputs.model_kwargs, use_cache=False).logits  # [B, K, V]
    batch = logits.shape[0]
    if batch > 1:
        logits = logits[torch.arange(batch, device=logits.device)[:, None], inputs.response_index]
    return full_vocab_log_probs(logits, inputs.response_tokens, temperature, with_entropy=with_entropy,
                                entropy_grad=entropy_grad)
