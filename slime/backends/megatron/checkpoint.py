"""The Megatron backend's checkpoint: model and optimizer as one ``torch.distributed.checkpoint`` under Hugging Face
names, scheduler and RNG; and the ``--save-hf`` export.  ``<iteration folder>/trainer/``::

    state/            full fp32 tensors: param/<hf name> (main weights), exp_avg/<hf name>, exp_avg_sq/<hf name>
                      (Adam's moments, not with --no-save-optim)
    scheduler.pt      {"optimizer_steps": n}
    rng_rank<r>.pt    rank r's torch / CUDA / Python / NumPy / megatron-core RNG states
    layout.json       the parallel sizes and dtype it was saved with (for people; nothing reads it)
    frozen_params.json  the frozen checkpoint names (no moments saved for them; :mod:`slime.backends.freeze`)

Each tensor is saved whole by its one source rank, in the Hugging Face layout, and a resume slices out its own
shards, so a checkpoint resumes at any TP / PP / EP / DP layout.  ``--save-hf DIR``: the ``param`` tensors as
safetensors, each rank writing its own files, rank 0 the index and the side files of ``--hf-checkpoint``.  Memory and
the optimizer's slices: ``docs/design/training_step.md``.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import Tensor

from slime.backends.freeze import frozen_change, write_frozen
from slime.backends.megatron.optimizer import STATE_KEYS
from slime.backends.megatron.weight_export import ordered_rules
from slime.backends.rng import rng_state, set_rng_state
from slime.checkpoints.layout import CheckpointError, explain_write_failure
from slime.models.qwen3_5.weights import ExportGroups, StateDictReader, export_rule, read_rank_state
from slime.weight_sync.buckets import bucket_by_bytes

logger = logging.getLogger(__name__)

STATE_DIR = "state"
SCHEDULER_FILE = "scheduler.pt"
MAX_SHARD_BYTES = 5 << 30
"""Target size of one safetensors file of a ``--save-hf`` folder (5 GiB, as ``save_pretrained``)."""


def save_trainer_state(
    trainer_dir: Path, model, optimizer, *, steps: int, save_optim: bool, layout: dict,
    save_hf: str | os.PathLike | None = None, hf_checkpoint: str | os.PathLike | None = None,
    frozen_hf: set[str] | None = None,
) -> None:
    """Write ``trainer_dir`` (replaced; module docstring) and, with ``save_hf``, the Hugging Face folder with
    ``hf_checkpoint``'s side files. Collective.  ``optimizer``: :class:`~.optimizer.DistributedAdam` or ``LocalAdam``;
    ``steps``: optimizer steps taken; ``save_optim``: also the moments; ``layout``: written to ``layout.json``;
    ``frozen_hf``: the frozen checkpoint names (their weights only; :data:`slime.backends.freeze.FROZEN_FILE`)."""
    frozen_hf = frozen_hf or set()
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(trainer_dir, ignore_errors=True)
        trainer_dir.mkdir(parents=True)
    dist.barrier()
    kinds = STATE_KEYS if save_optim else ("param",)
    groups = ExportGroups.current()
    state: dict[str, Tensor] = {}
    params = dict(model.named_parameters())
    for _, name, rule in ordered_rules(model, groups):
        if params[name].requires_grad:
            tensors = optimizer.param_state(params[name])  # collective over the parameter's optimizer DP group
        else:  # frozen: no optimizer state, its weight is the model's
            tensors = {"param": params[name].detach().float()}
        for kind in kinds if params[name].requires_grad else ("param",):
            for hf_name, value in (export_rule(rule, tensors[kind], groups) or {}).items():
                state[f"{kind}/{hf_name}"] = value.detach().to("cpu", torch.float32)
    try:
        dcp.save(state, checkpoint_id=trainer_dir / STATE_DIR)
    except Exception as err:  # a full disk reads as an unexplained zip-writer error: say so when it is one
        raise explain_write_failure(trainer_dir, sum(v.numel() * v.element_size() for v in state.values()), err)
    if rank == 0:
        torch.save({"optimizer_steps": steps}, trainer_dir / SCHEDULER_FILE)
        write_frozen(trainer_dir, frozen_hf)
        (trainer_dir / "layout.json").write_text(json.dumps(layout, indent=2) + "\n")
    torch.save(rng_state(), trainer_dir / f"rng_rank{rank:05d}.pt")
    if save_hf is not None:
        weights = {k[len("param/"):]: v for k, v in state.items() if k.startswith("param/")}
        write_hf_folder(Path(save_hf), weights, hf_checkpoint)
    dist.barrier()


def write_hf_folder(out: Path, weights: dict[str, Tensor], source: str | os.PathLike | None) -> None:
    """Every rank writes its own tensors into ``out`` as safetensors; rank 0 the index and side files. Collective."""
    from slime.backends.fsdp.hf_io import SAFETENSORS_INDEX, WEIGHT_FILE_PATTERNS, copy_side_files

    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for entry in out.iterdir():
            if any(fnmatch.fnmatch(entry.name, pattern) for pattern in WEIGHT_FILE_PATTERNS):
                entry.unlink()
        if source is not None:
            copy_side_files(source, out)
    dist.barrier()
    weight_map, total = {}, 0
    for k, shard in enumerate(bucket_by_bytes(([item] for item in sorted(weights.items())), MAX_SHARD_BYTES)):
        file = f"model-r{rank:05d}-{k:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in shard}, out / file, metadata={"format": "pt"})
        weight_map.update({n: file for n, _ in shard})
        total += sum(t.numel() * t.element_size() for _, t in shard)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (weight_map, total))
    if rank == 0:
        merged = {n: f for part, _ in gathered for n, f in part.items()}
        index = {"metadata": {"total_size": sum(t for _, t in gathered)}, "weight_map": dict(sorted(merged.items()))}
        (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        logger.info("--save-hf: %d tensors written to %s", len(merged), out)


def _checkpoint_keys(state_dir: Path) -> dict[str, torch.Size]:
    from torch.distributed.checkpoint import FileSystemReader

    if not (state_dir / ".metadata").is_file():
        raise CheckpointError(f"{state_dir} is not a torch.distributed.checkpoint folder (no .metadata)")
    metadata = FileSystemReader(str(state_dir)).read_metadata()
    return {k: v.size for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}


def _read(state_dir: Path, keys: list[str], sizes: dict[str, torch.Size]) -> dict[str, Tensor]:
    """The named full tensors of the checkpoint (fp32, CPU); this rank alone reads them (``no_dist``)."""
    out = {k: torch.empty(sizes[k], dtype=torch.float32) for k in keys}
    if out:
        dcp.load(out, checkpoint_id=state_dir, no_dist=True)
    return out


def _by_group(model, groups: ExportGroups):
    """The rank's rules grouped by export group, in the global order."""
    current, members = None, []
    for g, name, rule in ordered_rules(model, groups):
        if g != current and members:
            yield members
            members = []
        current = g
        members.append((name, rule))
    if members:
        yield members


def load_trainer_state(trainer_dir: Path, model, optimizer, *, load_optim: bool, frozen_hf: set[str] | None = None) -> int:
    """Restore weights (and the fp32 main weights), Adam's moments and step count, and RNG; returns the optimizer steps
    taken, or 0 with ``load_optim`` False (``--no-load-optim``: Adam and the LR schedule start afresh).  ``frozen_hf``:
    this run's frozen checkpoint names; a frozen parameter loads its weight only, and one frozen when saved but
    trained now starts Adam afresh (:func:`slime.backends.freeze.frozen_change` logs both kinds of change).

    Raises:
        CheckpointError: ``state/`` or ``scheduler.pt`` missing or malformed, a tensor the model needs missing, or no
            moments with ``load_optim`` (the message says ``--no-load-optim``).
    """
    state_dir = trainer_dir / STATE_DIR
    scheduler = trainer_dir / SCHEDULER_FILE
    if not scheduler.is_file():
        raise CheckpointError(f"{scheduler} is missing; the checkpoint is incomplete")
    steps = int(torch.load(scheduler)["optimizer_steps"])
    sizes = _checkpoint_keys(state_dir)
    kinds = STATE_KEYS if load_optim else ("param",)
    if load_optim and not any(k.startswith("exp_avg/") for k in sizes):
        raise CheckpointError(f"{state_dir} holds no optimizer state (saved with --no-save-optim?); resume with "
                              "--no-load-optim to start AdamW afresh")
    no_moments = set()
    if load_optim:
        optimizer.ensure_state()
        frozen_now = set(frozen_hf or ())
        no_moments = frozen_now | frozen_change(trainer_dir, frozen_now)[1]  # frozen now, or frozen when saved
    groups = ExportGroups.current()
    params = dict(model.named_parameters())
    for members in _by_group(model, groups):
        rules = {name: rule for name, rule in members}
        wanted = [f"{kind}/{hf}" for rule in rules.values() for hf in rule.hf_names
                  for kind in (("param",) if no_moments.intersection(rule.hf_names) else kinds)]
        missing = [k for k in wanted if k not in sizes]
        if missing:
            raise CheckpointError(f"{state_dir} has no tensor {missing[0]!r} (and {len(missing) - 1} more) that the "
                                  "model needs; was it saved from another model?")
        tensors = _read(state_dir, wanted, sizes)
        local = {kind: read_rank_state(StateDictReader({k[len(kind) + 1:]: v for k, v in tensors.items()
                                                        if k.startswith(kind + "/")}),
                                       {n: r for n, r in rules.items()
                                        if kind == "param" or not no_moments.intersection(r.hf_names)})
                 for kind in kinds}
        with torch.no_grad():
            for name in rules:  # the weights, and the fp32 main weights (with the moments when loaded)
                params[name].copy_(local["param"][name].to(params[name].dtype))
                if params[name].requires_grad:
                    optimizer.set_param_state(params[name], {k: local[k][name] for k in kinds if name in local[k]},
                                              steps)
    rng_file = trainer_dir / f"rng_rank{dist.get_rank():05d}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("%s is missing (saved with fewer ranks?); this rank keeps its fresh RNG state", rng_file)
    return steps if load_optim else 0


def load_weights(model, state_dir: Path) -> None:
    """Fill a built model's weights from a checkpoint's ``param/`` tensors (e.g. a ``--ref-load`` reference), one export
    group at a time; ``CheckpointError`` as :func:`load_trainer_state`."""
    sizes = _checkpoint_keys(state_dir)
    params = dict(model.named_parameters())
    for members in _by_group(model, ExportGroups.current()):
        rules = dict(members)
        wanted = [f"param/{hf}" for rule in rules.values() for hf in rule.hf_names]
        missing = [k for k in wanted if k not in sizes]
        if missing:
            raise CheckpointError(f"{state_dir} has no tensor {missing[0]!r} that the model needs")
        tensors = _read(state_dir, wanted, sizes)
        local = read_rank_state(StateDictReader({k[len("param/"):]: v for k, v in tensors.items()}), rules)
        with torch.no_grad():
            for name, value in local.items():
                params[name].copy_(value.to(params[name].dtype))
