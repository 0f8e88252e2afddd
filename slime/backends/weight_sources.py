"""Where the policy's and the reference model's weights come from: ``--hf-checkpoint``, ``--load``, ``--ref-load``.

One rule for every backend, resolved by :func:`resolve_weights` (the driver calls it before Ray starts to
check and log; each backend calls it in ``init`` to load):

- ``--hf-checkpoint H`` (a Hugging Face folder with weights) is always the architecture, tokenizer and
  processor, and what the engines start from;
- policy: ``--load L`` holding a checkpoint resumes from its latest one; ``L`` a Hugging Face folder (a
  ``config.json``, no checkpoint marker) is a fresh run from its weights; ``L`` absent, missing, or
  holding neither is a fresh run from ``H`` (so ``--save D --load D`` resumes when it can);
- reference (only with a KL term): ``--ref-load R``, the latest checkpoint's policy when ``R`` holds
  checkpoints, else ``R`` as a Hugging Face folder; without ``--ref-load``, the weights of ``H``.
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
    """One model's weights.

    Attributes:
        flag: the flag that named them: ``--hf-checkpoint``, ``--load`` or ``--ref-load``.
        path: a Hugging Face model folder, or with ``rollout_id`` a slime checkpoint root (a ``--save`` folder).
        rollout_id: the checkpoint under ``path`` (its latest complete one); None when ``path`` is a Hugging
            Face folder.
    """

    flag: str
    path: Path
    rollout_id: int | None = None

    def __str__(self) -> str:
        if self.rollout_id is None:
            return f"{self.flag} {self.path} (a Hugging Face folder)"
        return f"{self.flag} {self.path} (its checkpoint of rollout {self.rollout_id})"


@dataclasses.dataclass(frozen=True)
class StartingWeights:
    """What a run starts from (module docstring).

    Attributes:
        policy: the policy's weights: a checkpoint to resume (``rollout_id`` set: optimizer, scheduler, RNG
            and data cursor come from it too) or a Hugging Face folder (a fresh run).
        reference: the reference model's weights, None when no KL term needs one.
        note: why a given ``--load`` was not used (empty otherwise), for the log.
    """

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
    """Resolve ``--hf-checkpoint``, ``--load`` and ``--ref-load`` by the module's rule; reads the file system only.

    Args:
        checkpoint: the run's CKPT_ARGS (``hf_checkpoint``, ``load``, ``ref_load``).
        need_reference: a KL term needs a reference model (``GRPOConfig.needs_ref_model``); otherwise
            ``--ref-load`` is not read.
        backend_parts: the parts a checkpoint of the training backend holds
            (:meth:`slime.backends.config.BackendConfig.checkpoint_parts`): a resume checks them;
            empty: not checked (the backend reads them itself).

    Raises:
        CheckpointError: ``--hf-checkpoint`` is not a Hugging Face folder with weights; ``--load`` is a
            Hugging Face folder without weights, or its latest checkpoint is malformed or lacks a part;
            ``--ref-load`` is neither a checkpoint root nor a Hugging Face folder.  Each names the flag.
    """
    hf = Path(checkpoint.hf_checkpoint)
    check_hf_folder(hf, "--hf-checkpoint")
    policy, note = WeightSource("--hf-checkpoint", hf), ""
    load = checkpoint.load
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
