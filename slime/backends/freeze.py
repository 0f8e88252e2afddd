"""Freezing parameters by name (``--freeze-params-name-list`` / ``--only-train-params-name-list``), for every backend.

Patterns are Python regular expressions matched with ``re.search`` (as upstream slime) against the parameters'
**Hugging Face checkpoint names** (``model.visual.blocks.0.attn.qkv.weight``), whatever the backend's own names, so
one command line freezes the same tensors under FSDP and Megatron.  A backend parameter holding several checkpoint
tensors (fused experts, Megatron's fused QKV) is frozen only when all of them match; some but not all is an error.
Frozen parameters get ``requires_grad`` False before the optimizer is built (no gradient, no optimizer state).
Rationale, weight sync and resume rules: ``docs/design/freezing.md``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from slime.backends.config import compile_patterns
from slime.utils.config import ConfigError

if TYPE_CHECKING:
    from slime.backends.config import TrainConfig

logger = logging.getLogger(__name__)

FROZEN_FILE = "frozen_params.json"
"""In a checkpoint's ``trainer/`` folder: the sorted checkpoint names frozen when it was saved (a resume compares)."""
_SHOWN = 5


def select_frozen(hf_names: Mapping[str, Sequence[str]], *, freeze: Sequence[str] | None,
                  only_train: Sequence[str] | None, device: torch.device | str = "cpu") -> set[str]:
    """The backend parameters to freeze.

    Args:
        hf_names: this rank's parameters, ``{backend name: its checkpoint names}``.
        freeze, only_train: the two flags' patterns (at most one of them given; neither: nothing frozen).
        device: where the collective's tensor lives (the default group's device type).

    Returns:
        The backend names of the frozen parameters on this rank.

    Raises:
        ConfigError: a pattern matches no checkpoint name on any rank, a parameter's checkpoint names are matched
            only in part, or nothing is left to train; raised on every rank (one all-reduce decides).
    """
    flag = "--freeze-params-name-list" if freeze else "--only-train-params-name-list"
    patterns = list(freeze or only_train or ())
    if not patterns:
        return set()
    compiled = compile_patterns(flag, patterns)
    hits = torch.zeros(len(patterns) + 2, dtype=torch.float64)
    frozen, partial = set(), []
    for name, names in hf_names.items():
        matched = []
        for hf in names:
            found = [i for i, c in enumerate(compiled) if c.search(hf)]
            for i in found:
                hits[i] += 1
            matched.append(bool(found))
        if any(matched) and not all(matched):
            partial.append(f"{name} ({sum(matched)} of its {len(matched)} checkpoint tensors match, e.g. "
                           f"{next(h for h, m in zip(names, matched) if m)!r} but not "
                           f"{next(h for h, m in zip(names, matched) if not m)!r})")
        if all(matched) == bool(freeze):
            frozen.add(name)
    hits[-2] = len(partial)
    hits[-1] = len(hf_names) - len(frozen)
    if dist.is_initialized():
        on_device = hits.to(device)
        dist.all_reduce(on_device)
        hits = on_device.cpu()
    unmatched = [p for p, n in zip(patterns, hits[:-2].tolist()) if n == 0]
    if unmatched:
        raise ConfigError(f"{flag}: the pattern(s) {unmatched} match no parameter of the policy (patterns are searched "
                          "in Hugging Face checkpoint names, e.g. 'model.visual.' for the vision tower)")
    if hits[-2] > 0:
        raise ConfigError(f"{flag} {patterns}: a parameter is matched only in part "
                          f"({'; '.join(partial[:_SHOWN]) or 'on another rank'}); widen or narrow the pattern so that "
                          "it takes all of a fused tensor's checkpoint names or none")
    if hits[-1] == 0:
        raise ConfigError(f"{flag} {patterns} freezes every parameter of the policy: nothing is left to train")
    return frozen


def freeze_policy(model: torch.nn.Module, train: TrainConfig,
                  hf_names_by_param: Callable[[], Mapping[str, Sequence[str]]],
                  device: torch.device | str = "cpu") -> tuple[frozenset[str], frozenset[str]]:
    """Freeze the policy's parameters ``--freeze-params-name-list`` / ``--only-train-params-name-list`` name (in
    ``train``); a backend calls it in ``init`` after building the policy and before building the optimizer.
    ``hf_names_by_param()``: this rank's ``{backend name: its checkpoint names}``, asked only when a flag is given.
    Collective when a flag is given.

    Returns:
        ``(frozen, frozen_hf_names)``: this rank's frozen parameters by backend name, and the checkpoint names of
        every frozen tensor over all ranks (what the weight sync sends once); both empty without a flag.

    Raises:
        ConfigError: a pattern matches nothing, matches part of a fused tensor, or freezes everything.
    """
    if not (train.freeze_params_name_list or train.only_train_params_name_list):
        return frozenset(), frozenset()
    names = hf_names_by_param()
    chosen = select_frozen(names, freeze=train.freeze_params_name_list,
                           only_train=train.only_train_params_name_list, device=device)
    count = freeze(model, chosen)
    frozen_hf = frozenset(gather_names({hf for name in chosen for hf in names[name]}))
    logger.info("frozen: %d parameters on this rank (%d elements), %d checkpoint tensors in all",
                len(chosen), count, len(frozen_hf))
    return frozenset(chosen), frozen_hf


def freeze(model: torch.nn.Module, names: set[str]) -> int:
    """Set ``requires_grad`` False on ``model``'s parameters named in ``names``; returns their element count."""
    count = 0
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)
            count += param.numel()
    return count


def gather_names(names: set[str]) -> set[str]:
    """The union of ``names`` over every rank (collective when a process group exists)."""
    if not dist.is_initialized():
        return set(names)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, sorted(names))
    return {n for part in parts for n in part}


def write_frozen(trainer_dir: Path, frozen_hf: set[str]) -> None:
    """Record the checkpoint names frozen at save time (:data:`FROZEN_FILE`); call on one rank."""
    (Path(trainer_dir) / FROZEN_FILE).write_text(json.dumps(sorted(frozen_hf), indent=1) + "\n")


def frozen_change(trainer_dir: Path, frozen_hf: set[str]) -> tuple[set[str], set[str]]:
    """Compare the frozen set saved in ``trainer_dir`` with this run's (checkpoint names).

    Returns ``(newly_frozen, newly_trained)``: names trained when saved and frozen now (their optimizer state in the
    checkpoint is dropped), and names frozen when saved and trained now (their optimizer state starts fresh: zero
    moments, step 0).  A checkpoint without :data:`FROZEN_FILE` froze nothing.  Logs one warning for each non-empty
    set, naming the tensors."""
    path = Path(trainer_dir) / FROZEN_FILE
    saved = set(json.loads(path.read_text())) if path.is_file() else set()
    newly_frozen, newly_trained = frozen_hf - saved, saved - frozen_hf
    if newly_frozen:
        logger.warning("resume from %s with another frozen set: %d tensors trained in the checkpoint are frozen now; "
                       "their optimizer state is dropped: %s", trainer_dir, len(newly_frozen), _listing(newly_frozen))
    if newly_trained:
        logger.warning("resume from %s with another frozen set: %d tensors frozen in the checkpoint are trained now; "
                       "their optimizer state starts fresh (zero moments, step 0): %s", trainer_dir,
                       len(newly_trained), _listing(newly_trained))
    return newly_frozen, newly_trained


def _listing(names: set[str]) -> str:
    ordered = sorted(names)
    return ", ".join(ordered[:20]) + (f" and {len(ordered) - 20} more" if len(ordered) > 20 else "")
