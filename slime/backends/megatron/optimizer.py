"""Gradient reduction and AdamW for the Megatron backend: megatron-core's on GPU, a small torch stand-in on CPU.

GPU (:class:`DistributedAdam`): megatron-core's ``DistributedDataParallel`` and distributed optimizer (bf16
parameters; fp32 main parameters and moments sharded over data-parallel ranks, the experts' over the
expert-data-parallel group).  CPU (:class:`LocalAdam`): :class:`LocalDataParallel` and ``torch.optim.AdamW``, data
parallelism only.  Both decay tensors of two or more dimensions only, take the global gradient L2 norm over every
rank's shards (TP duplicates once), and expose each parameter's optimizer state as whole TP-local fp32 tensors
(:data:`STATE_KEYS`) for checkpoints.  Why the stand-in: ``docs/design/training_step.md``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from slime.backends.config import OptimizerConfig
from slime.backends.host_offload import HostParking
from slime.backends.megatron.config import MegatronConfig

logger = logging.getLogger(__name__)

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""Per-parameter optimizer state saved in checkpoints: fp32 main weights and Adam's two moments."""


def decays(name: str, param: Tensor) -> bool:
    """Whether weight decay applies: tensors of >= 2 dims that are not biases (megatron-core's default rule)."""
    return param.ndim >= 2 and not name.endswith(".bias")


class DistributedAdam:
    """megatron-core's DDP + distributed AdamW around one pipeline stage (GPU only); ``megatron``, ``optimizer``:
    BACKEND_ARGS and OPTIMIZER_ARGS; ``bf16``: bf16 parameters with fp32 main copies in the optimizer."""

    def __init__(self, model: torch.nn.Module, megatron: MegatronConfig, optimizer: OptimizerConfig, bf16: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        tc = model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=megatron.accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=True,
        )
        self.ddp = DistributedDataParallel(config=tc, ddp_config=ddp_config, module=model)
        self.cfg = optimizer
        mcore = McoreOptimizerConfig(
            optimizer="adam", lr=optimizer.lr, min_lr=optimizer.min_lr, weight_decay=optimizer.weight_decay,
            adam_beta1=optimizer.adam_beta1, adam_beta2=optimizer.adam_beta2, adam_eps=optimizer.adam_eps,
            clip_grad=optimizer.clip_grad, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(mcore, [self.ddp])
        self.parts = list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))
        self.frozen = [p for p in model.parameters() if not p.requires_grad]  # in no DDP buffer: moved by hand
        self.parking = HostParking(pin=True)  # the optimizer state while colocated engines hold the GPU
        self._onload_stream: torch.cuda.Stream | None = None  # the background restore's copies (move_training_state)

    @property
    def model(self) -> torch.nn.Module:
        """What the schedule runs (the DDP wrapper)."""
        return self.ddp

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def grad_norm(self) -> float:
        """Reduce-scattered gradients -> their global L2 norm (megatron-core's, TP duplicates counted once)."""
        self.parking.wait()  # the first use of the optimizer state after an onload
        self.optimizer.prepare_grads()
        return float(self.optimizer.get_grad_norm())

    def step(self, lr: float, grad_scale: float) -> None:
        """Scale the fp32 main gradients by ``grad_scale`` (``--clip-grad``), then AdamW at ``lr``, then zero the
        gradients for the next step; after :meth:`grad_norm`."""
        self.parking.wait()
        for part in self.parts:
            for group in part.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
                group["weight_decay"] = self.cfg.weight_decay * group.get("wd_mult", 1.0)
            if grad_scale < 1.0:
                grads = [p.grad for p in part.get_parameters() if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, grad_scale)
        if not self.optimizer.step_with_ready_grads():
            raise RuntimeError("megatron-core's optimizer step did not succeed")
        self.zero_grad()

    # ---------------------------------------------------------------- state of one parameter

    def _owner(self, param: Tensor):
        for part in self.parts:
            if any(param in buffer.param_index_map for buffer in getattr(part, "buffers", ())):
                return part
        raise KeyError("parameter is in no optimizer buffer")

    def ensure_state(self) -> None:
        """Create Adam's moments before a load (torch creates them at the first step; megatron-core's own
        checkpoint loader does the same dummy step, whose effect the load then overwrites)."""
        self.parking.wait()
        for part in self.parts:
            if not part.optimizer.state:
                part._init_optimizer_states_with_dummy_values()

    @staticmethod
    def _main_param(part, param: Tensor) -> Tensor:
        """The fp32 main parameter (this rank's flat shard) of model parameter ``param`` in ``part``, paired through the
        lists megatron-core builds its groups from (its own ``_get_main_param_and_optimizer_states`` returns another
        parameter's state in 0.16.1: ``docs/design/training_step.md``)."""
        mapping = part.__dict__.get("_slime_main_params")
        if mapping is None:
            mapping = {}
            for models, mains in ((part.model_float16_groups, part.shard_fp32_from_float16_groups),
                                  (part.model_fp32_groups, part.shard_fp32_groups)):
                for model_group, main_group in zip(models, mains):
                    for model_param, main_param in zip(model_group, main_group):
                        mapping[model_param] = main_param
            part.__dict__["_slime_main_params"] = mapping
        return mapping[param]

    def _shard_state(self, part, param: Tensor) -> dict[str, Tensor]:
        """``{"param": main shard, "exp_avg": ..., "exp_avg_sq": ..., "step": ...}`` (moments once they exist)."""
        main = self._main_param(part, param)
        return {"param": main, **part.optimizer.state.get(main, {})}

    def param_state(self, param: Tensor) -> dict[str, Tensor]:
        """``{param, exp_avg, exp_avg_sq}`` of one model parameter as whole fp32 tensors of its local shape; collective
        over its optimizer's DP group (the same parameters in the same order on every rank).  Reads the parked host
        copy while the state is off the device (a save after the colocated step's offload); then, with one rank in
        the DP group (nothing to all-reduce), the tensors are built in host memory too: the colocated engines hold
        the GPU, and a save after the MTP server's resume ran out of device memory building them there (1.9 GiB for
        one fused expert weight of the scaled model, 0.97 GiB free; H100, 2026-12-07)."""
        self.parking.wait()
        part = self._owner(param)
        shard = {}
        if param in part.model_param_gbuf_map:
            sl = part._get_model_param_range_map(param)["param"]
            shard = {k: self._readable(t) for k, t in self._shard_state(part, param).items() if k in STATE_KEYS}
        alone = dist.get_world_size(part.data_parallel_group) == 1
        on_host = alone and any(t.device.type == "cpu" for t in shard.values())
        device = torch.device("cpu") if on_host else param.device
        full = {k: torch.zeros(param.numel(), dtype=torch.float32, device=device) for k in STATE_KEYS}
        for k, t in shard.items():
            full[k][sl.start: sl.end].copy_(t.detach())  # a host shard into a device tensor: no device temporary
        if not alone:
            flat = torch.cat([full[k] for k in STATE_KEYS])
            dist.all_reduce(flat, group=part.data_parallel_group)
            full = dict(zip(STATE_KEYS, flat.chunk(len(STATE_KEYS))))
        return {k: full[k].view(param.shape) for k in STATE_KEYS}

    def _readable(self, t: Tensor) -> Tensor:
        """``t`` to read while the colocated step's state is off the device (no copy): the parked host bytes of
        optimizer state (:meth:`HostParking.readable`), or, for a view into a DDP parameter buffer that megatron-core's
        ``offload_to_cpu`` has freed, the same view of that buffer's pinned CPU copy (``param_data_cpu``).  The second
        case is the fp32 main weight of an fp32 model parameter (``A_log``): a view of the parameter itself, so of its
        buffer, which :meth:`move_weights` offloads; reading the freed storage fails ("CUDA error: invalid argument",
        the H100 run of 2026-12-06, at the save after a colocated step)."""
        t = self.parking.readable(t)
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            return t
        for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            data, host = buffer.param_data, getattr(buffer, "param_data_cpu", None)
            if data is None or host is None or data.dtype != t.dtype or data.untyped_storage()._cdata != storage._cdata:
                continue
            offset = t.storage_offset() - data.storage_offset()
            return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), host.storage_offset() + offset, t.shape,
                                                      t.stride())
        return t

    def set_param_state(self, param: Tensor, state: dict[str, Tensor], steps: int) -> None:
        """Write whole-parameter ``state`` (as from :meth:`param_state`; ``param`` alone, or with the moments)
        into this rank's shard; Adam's ``step`` becomes ``steps`` where the state exists.  The model weight
        itself is written by the caller."""
        self.parking.wait()
        part = self._owner(param)
        if param not in part.model_param_gbuf_map:
            return
        sl = part._get_model_param_range_map(param)["param"]
        shard = self._shard_state(part, param)
        for key, value in shard.items():
            if key == "step":
                value.fill_(steps)
            elif key in state:
                value.copy_(state[key].reshape(-1)[sl.start: sl.end].to(value.dtype))

    # ---------------------------------------------------------------- colocated memory

    def move_weights(self, onto_device: bool) -> None:
        """Move the model's parameter buffers (bf16 with ``--bf16``) off the GPU (megatron-core's RL offload API:
        a pinned CPU copy, storage resized to 0) or back (``onto_device``)."""
        for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers:
            if onto_device:
                buffer.reload_from_cpu(move_params=True, move_grads=False)
            else:
                buffer.offload_to_cpu(move_params=True, move_grads=False)
        device = torch.device("cuda", torch.cuda.current_device()) if onto_device else torch.device("cpu")
        for param in self.frozen:  # frozen parameters (--freeze-params-name-list): their own storage, moved once
            param.data = param.data.to(device, non_blocking=True)

    def move_training_state(self, onto_device: bool) -> None:
        """Free the gradient buffers (megatron-core's ``offload_grad_buffers``) and park the optimizer state (fp32
        main weights, moments) in pinned host memory (:class:`slime.backends.host_offload.HostParking`, not
        megatron-core's ``offload_to_cpu``: why in its module docstring), or restore both (the gradient buffers
        zeroed).

        The optimizer state comes back in the background, on a side stream (:meth:`HostParking.restore`): nothing reads
        it before :meth:`grad_norm` (which waits for the copies), so its 12 bytes a parameter cross PCIe while the
        forward and backward passes run; the gradient buffers, which the backward pass writes, are restored first and
        synchronously."""
        if onto_device:
            self.ddp.restore_grad_buffers(synchronize=True)
            if self._onload_stream is None:
                self._onload_stream = torch.cuda.Stream()
            self.parking.restore(stream=self._onload_stream)
        else:
            self.ddp.offload_grad_buffers(synchronize=True, empty_cache=False)
            self.parking.park(self._optimizer_tensors())

    def _optimizer_tensors(self) -> Iterator[Tensor]:
        """Every tensor the optimizer holds, its (fp32 main) parameters and their state (moments, step), except views
        into DDP's parameter and gradient buffers: the main parameter of an fp32 model parameter (``A_log``) is a
        view of the model parameter itself, which :meth:`move_weights` moves with its buffer."""
        buffers = {t.untyped_storage()._cdata for b in self.ddp.buffers + self.ddp.expert_parallel_buffers
                   for t in (b.param_data, b.grad_data) if t is not None}
        for part in self.parts:
            held = [p for group in part.optimizer.param_groups for p in group["params"]]
            held += [v for state in part.optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
            yield from (t for t in held if t.untyped_storage()._cdata not in buffers)


class LocalDataParallel(torch.nn.Module):
    """CPU stand-in for megatron-core's ``DistributedDataParallel``: what its schedule and ``finalize_model_grads``
    call, gradients in ``.grad`` averaged over the data-parallel group at the end of the step (a missing one as zeros,
    so every rank reduces the same tensors)."""

    def __init__(self, module: torch.nn.Module, dp_group: dist.ProcessGroup):
        from megatron.core.distributed import DistributedDataParallelConfig

        super().__init__()
        self.module = module
        self.config = module.config
        self.ddp_config = DistributedDataParallelConfig()
        self.dp_group = dp_group

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor) -> None:
        self.module.set_input_tensor(tensor)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # gradients accumulate in .grad; nothing is reduced before finish_grad_sync

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        size = dist.get_world_size(self.dp_group)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if size > 1:
            for dtype in sorted({p.dtype for p in params}, key=str):
                group = [p for p in params if p.dtype == dtype]
                flat = torch.cat([p.grad.reshape(-1) for p in group])
                dist.all_reduce(flat, group=self.dp_group)
                flat.div_(size)
                for p, g in zip(group, flat.split([p.numel() for p in group])):
                    p.grad.copy_(g.view_as(p))

    def scale_gradients(self, factor: float) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def zero_grad_buffer(self) -> None:
        for p in self.module.parameters():
            p.grad = None


class LocalAdam:
    """Data-parallel training on CPU: :class:`LocalDataParallel` + ``torch.optim.AdamW`` on fp32 parameters (its
    gradient norm handles TP shards too); ``dp_group``, ``tp_group``: megatron-core's groups."""

    def __init__(self, model: torch.nn.Module, optimizer: OptimizerConfig, dp_group, tp_group):
        self.wrapper = LocalDataParallel(model, dp_group)
        self.cfg = optimizer
        self.tp_group = tp_group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for n, p in named if decays(n, p)], "wd_mult": 1.0},
             {"params": [p for n, p in named if not decays(n, p)], "wd_mult": 0.0}],
            lr=optimizer.lr, betas=(optimizer.adam_beta1, optimizer.adam_beta2), eps=optimizer.adam_eps,
            weight_decay=optimizer.weight_decay,
        )

    @property
    def model(self) -> torch.nn.Module:
        return self.wrapper

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> float:
        """Global L2 norm: TP-sharded parameters count on every TP rank, replicated ones once."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        square = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                square += p.grad.double().pow(2).sum()
        if dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(square, group=self.tp_group)
        return float(square.sqrt())

    def step(self, lr: float, grad_scale: float) -> None:
        """Scale the gradients by ``grad_scale`` (``--clip-grad``), then AdamW at ``lr``, then free the gradients."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["weight_decay"] = self.cfg.weight_decay * group["wd_mult"]
        if grad_scale < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        self.optimizer.step()
        self.zero_grad()

    def ensure_state(self) -> None:
        for p in self.params:
            state = self.optimizer.state[p]
            if not state:
                state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                             exp_avg_sq=torch.zeros_like(p))

    def param_state(self, param: Tensor) -> dict[str, Tensor]:
        state = self.optimizer.state.get(param, {})
        zeros = torch.zeros_like(param, dtype=torch.float32)
        return {"param": param.detach().float(), "exp_avg": state.get("exp_avg", zeros).float(),
                "exp_avg_sq": state.get("exp_avg_sq", zeros).float()}

    def set_param_state(self, param: Tensor, state: dict[str, Tensor], steps: int) -> None:
        """Adam's moments and step (when ``state`` has them); the fp32 weight is the parameter itself."""
        if "exp_avg" not in state:
            return
        slot = self.optimizer.state[param]
        slot["step"] = torch.tensor(float(steps))
        for key in ("exp_avg", "exp_avg_sq"):
            slot[key] = state[key].to(param.dtype).clone()

    def move_weights(self, onto_device: bool) -> None:  # CPU: nothing to move (the backend never calls it)
        pass

    def move_training_state(self, onto_device: bool) -> None:
        pass
