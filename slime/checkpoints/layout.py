"""Checkpoint folder layout, shared by the driver and every training backend.

``--save DIR`` writes one folder per saved rollout step::

    DIR/
      latest_checkpointed_iteration.txt   # "7": the last COMPLETE checkpoint (Megatron's name)
      iter_0000007/
        model/            # Hugging Face folder, usable as --hf-checkpoint (FSDP's weights)
        trainer/          # backend-private: optimizer, LR scheduler, per-rank RNG (Megatron: weights too)
        rollout_state.pt  # driver: rollout id and data cursor

A complete checkpoint holds the backend's parts (:meth:`slime.backends.config.BackendConfig.checkpoint_parts`)
and ``rollout_state.pt``; the driver writes the marker last, atomically, so a run killed mid-save resumes
from the previous one.  ``--load DIR`` resumes from the iteration the marker names.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

from slime.errors import SlimeError

LATEST_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(SlimeError, RuntimeError):
    """A checkpoint folder is missing or malformed; the message names the path."""


def iteration_dir(root: str | os.PathLike, rollout_id: int) -> Path:
    """``root/iter_<rollout_id:07d>``."""
    return Path(root) / f"iter_{rollout_id:07d}"


def model_dir(root: str | os.PathLike, rollout_id: int) -> Path:
    """The Hugging Face model folder of one checkpoint."""
    return iteration_dir(root, rollout_id) / "model"


def trainer_dir(root: str | os.PathLike, rollout_id: int) -> Path:
    """The backend-private folder of one checkpoint."""
    return iteration_dir(root, rollout_id) / "trainer"


def rollout_state_path(root: str | os.PathLike, rollout_id: int) -> Path:
    """The driver's state file of one checkpoint."""
    return iteration_dir(root, rollout_id) / "rollout_state.pt"


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The rollout id of the last complete checkpoint under ``root``, or None if there is none.

    Raises:
        CheckpointError: the marker file exists but is malformed, or names a missing folder.
    """
    marker = Path(root) / LATEST_FILE
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    try:
        rollout_id = int(text)
    except ValueError:
        raise CheckpointError(f"{marker}: expected an integer rollout id, found {text!r}") from None
    if not iteration_dir(root, rollout_id).is_dir():
        raise CheckpointError(f"{marker} names rollout {rollout_id}, but {iteration_dir(root, rollout_id)} is missing")
    return rollout_id


def check_not_a_file(root: str | os.PathLike | None, flag: str = "--load") -> None:
    """Refuse a checkpoint root (``--load``) that exists but is a file: read as a folder it would hold no checkpoint,
    and the run would start fresh from ``--hf-checkpoint`` without saying so.  None or a missing path passes.

    Raises:
        CheckpointError: naming ``flag`` and the path.
    """
    if root is not None and Path(root).exists() and not Path(root).is_dir():
        raise CheckpointError(
            f"{flag} {root} is a file, not a folder; give the --save folder of the run to resume (or a Hugging Face "
            f"model folder), or drop {flag} to start from --hf-checkpoint"
        )


def mark_latest(root: str | os.PathLike, rollout_id: int) -> None:
    """Atomically record ``rollout_id`` as the last complete checkpoint under ``root``."""
    marker = Path(root) / LATEST_FILE
    tmp = marker.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(f"{rollout_id}\n")
    os.replace(tmp, marker)


def check_complete(root: str | os.PathLike, rollout_id: int, backend_parts: Sequence[str]) -> None:
    """Check that checkpoint ``rollout_id`` of ``root`` (``--load``) has ``backend_parts`` and ``rollout_state.pt``.

    Raises:
        CheckpointError: naming the first missing part and the ``--load`` folder.
    """
    parts = [iteration_dir(root, rollout_id) / part for part in backend_parts]
    for part in (*parts, rollout_state_path(root, rollout_id)):
        if not part.exists():
            raise CheckpointError(
                f"--load {root}: the latest checkpoint (rollout {rollout_id}) lacks {part}; the folder is not a slime "
                f"checkpoint or was damaged. Point --load at the --save folder of a run, or remove {Path(root) / LATEST_FILE} "
                "to start from --hf-checkpoint"
            )


def explain_write_failure(folder: str | os.PathLike, needed_bytes: int, error: BaseException) -> BaseException:
    """The error to raise when writing ``needed_bytes`` of checkpoint into ``folder`` failed with ``error``.

    A :class:`CheckpointError` with the free and needed GiB, chained to ``error``, when the disk has less than
    ``needed_bytes`` free (torch reports a full disk as ``inline_container.cc ... unexpected pos``); else ``error``.
    """
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free >= needed_bytes:
        return error
    message = (f"writing the checkpoint into {folder} failed with the disk nearly full: {free / 2**30:.2f} GiB free "
               f"there, and this rank writes {needed_bytes / 2**30:.1f} GiB (weights and, unless --no-save-optim, the "
               f"optimizer state in float32). Free space, point --save at a larger disk, or delete older iteration "
               f"folders ({error})")
    failure = CheckpointError(message)
    failure.__cause__ = error
    return failure
