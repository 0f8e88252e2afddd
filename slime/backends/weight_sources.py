"""Where the policy's and the reference model's weights come from: ``--hf-checkpoint``, ``--load``, ``--ref-load``.

One rule for every backend (:func:`resolve_weights`, called by the driver before Ray starts and by each backend in
``init``): the policy resumes from ``--load``'s latest checkpoint, starts from ``--load`` as a Hugging Face folder,
or else from ``--hf-checkpoint``; the reference (with a KL term) is ``--ref-load`` (its latest policy, or a Hugging
Face folder), else ``--hf-checkpoint``.  In full: ``docs/design/training_step.md``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from slime.checkpoints import layout as ckpt
from slime.checkpoints.hf import check_hf_folder, has_config

if TYPE_CHECKING:
    from slime.backends.config import CheckpointConfig


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """One model's weights: the ``flag`` that named them (``--hf-checkpoint``, ``--load``, ``--ref-load``) and ``path``,
    a Hugging Face folder, or with ``rollout_id`` a ``--save`` root whose checkpoint of that rollout is meant."""

    flag: str
    path: Path
    rollout_id: int | None = None

    def __str__(self) -> str:
        if self.rollout_id is None:
            return f"{self.flag} {self.path} (a Hugging Face folder)"
        return f"{self.flag} {self.path} (its checkpoint of rollout {self.rollout_id})"


@dataclasses.dataclass(frozen=True)
class StartingWeights:
    """What a run starts from: the ``policy``'s weights (a checkpoint to resume, ``rollout_id`` set, with its optimizer,
    scheduler, RNG and data cursor; or a Hugging Face folder), the ``reference``'s (None without a KL term), and a
    ``note`` on why a given ``--load`` was not used (for the log)."""

    policy: WeightSource
    reference: WeightSource | None = None
    note: str = ""

    @property
    def next_rollout_id(self) -> int:
        """The first rollout to run: 0 for a fresh run, ``k + 1`` after the checkpoint of rollout ``k``."""
        return 0 if self.policy.rollout_id is None else self.policy.rollout_id + 1

    def describe(self) -> str:
        """One line for the log: where both models start from, and why a ``--load`` was not used."""
        verb = "resumes from" if self.policy.rollout_id is not None else "starts from"
        text = f"the policy {verb} {self.policy}" + (f" ({self.note})" if self.note else "")
        return text + ("" if self.reference is None else f"; the reference model is {self.reference}")


def resolve_weights(
    checkpoint: CheckpointConfig, *, need_reference: bool, backend_parts: Sequence[str] = ()
) -> StartingWeights:
    """Resolve ``--hf-checkpoint``, ``--load`` and ``--ref-load`` (CKPT_ARGS) by the module's rule, reading the file
    system only; ``--ref-load`` only with ``need_reference``; a resume checks that the checkpoint holds
    ``backend_parts`` (:meth:`slime.backends.config.BackendConfig.checkpoint_parts`; empty: not checked).

    Raises:
        CheckpointError: naming the flag: ``--hf-checkpoint`` is not a Hugging Face folder with weights; ``--load`` is
            a file, or a Hugging Face folder without weights, or its latest checkpoint is malformed or lacks a part; ``--ref-load`` is neither a
            checkpoint root nor a Hugging Face folder.
    """
    hf = Path(checkpoint.hf_checkpoint)
    check_hf_folder(hf, "--hf-checkpoint")
    policy, note = WeightSource("--hf-checkpoint", hf), ""
    load = checkpoint.load
    ckpt.check_not_a_file(load)
    if load is not None:
        latest = ckpt.latest_iteration(load)
        if latest is not None:
            if backend_parts:
                ckpt.check_complete(load, latest, backend_parts)
            policy = WeightSource("--load", Path(load), latest)
        elif has_config(load):
            check_hf_folder(load, "--load")
            policy = WeightSource("--load", Path(load))
        elif not Path(load).exists():
            note = f"--load {load} does not exist"
        else:
            note = f"--load {load} holds no checkpoint yet"
    reference = None
    if need_reference:
        reference = WeightSource("--hf-checkpoint", hf)
        ref_load = checkpoint.ref_load
        if ref_load is not None:
            latest = ckpt.latest_iteration(ref_load)
            if latest is None:
                check_hf_folder(ref_load, "--ref-load")
            reference = WeightSource("--ref-load", Path(ref_load), latest)
    return StartingWeights(policy, reference, note)
