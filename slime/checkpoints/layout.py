"""Checkpoint folder layout, shared by the driver and every training backend.

``--save DIR`` writes one folder per saved rollout step::

    DIR/
      latest_checkpointed_iteration.txt   # "7": the last COMPLETE checkpoint (Megatron's name)
      iter_0000007/
        model/            # Hugging Face folder (config, safetensors, tokenizer, processor):
                          # loadable by transformers.from_pretrained, usable as --hf-checkpoint
                          # (the FSDP backend's weights; other backends write it on request)
        trainer/          # backend-private: optimizer, LR scheduler, per-rank RNG state
                          # (the Megatron backend: weights and optimizer in one torch.distributed.checkpoint)
        rollout_state.pt  # driver: rollout id and data cursor (epoch, position, skip counts)

Which parts a complete checkpoint holds is the backend's to say
(:meth:`slime.backends.config.BackendConfig.checkpoint_parts`: FSDP ``model/`` + ``trainer/``,
Megatron ``trainer/state`` + ``trainer/scheduler.pt``);
``rollout_state.pt`` is always the driver's.

Randomness: the prompt order is a pure function of ``--rollout-seed`` and the epoch, so the
data cursor restores it exactly; each trainer rank's torch/numpy/python RNG is in
``trainer/``.  Sampling needs no state in the checkpoint: every request carries a seed that is
a pure function of ``--rollout-seed``, the rollout id and the request's position in its rollout
(:mod:`slime.rollout.seeds`), so the responses sampled after a resume are the ones the killed
run would have sampled (exactly on the transformers engine; on SGLang with its deterministic
inference mode).

The marker file is written last, atomically, by the driver once every part is on disk, so
a run killed in the middle of a save resumes from the previous complete checkpoint.
``--load DIR`` resumes from the iteration the marker names.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

LATEST_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing or malformed; the message names the path."""


def iteration_dir(root: str | os.PathLike, rollout_id: int) -> Path:
    """``root/iter_<rollout_id:07d>``."""
    return Path(root) / f"iter_{rollout_id:07d}"


def model_dir(root: str | os.PathLike, rollout_id: int) -> Path:
    """The Hugging Face model folder of one checkpoint."""
    return iteration_dir(root, rollout_id) / "model"


def trainer_dir(root: str | os.PathLike, rollout_id: int) -> Path:
    """The backend-private folder (optimizer, scheduler, RNG) of one checkpoint."""
    return iteration_dir(root, rollout_id) / "trainer"


def rollout_state_path(root: str | os.PathLike, rollout_id: int) -> Path:
    """The driver's state file (rollout id, data cursor) of one checkpoint."""
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


def mark_latest(root: str | os.PathLike, rollout_id: int) -> None:
    """Atomically record ``rollout_id`` as the last complete checkpoint under ``root``."""
    marker = Path(root) / LATEST_FILE
    tmp = marker.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(f"{rollout_id}\n")
    os.replace(tmp, marker)


def check_complete(root: str | os.PathLike, rollout_id: int, backend_parts: Sequence[str]) -> None:
    """Check that the checkpoint of ``rollout_id`` under ``root`` has every part a resume reads.

    Args:
        root: the ``--load`` folder.
        rollout_id: the checkpoint's rollout id.
        backend_parts: the training backend's parts, relative to the iteration folder
            (:meth:`slime.backends.config.BackendConfig.checkpoint_parts`, e.g. ``("model", "trainer")``);
            the driver's ``rollout_state.pt`` is checked too.

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


def check_hf_folder(path: str | os.PathLike, flag: str = "--hf-checkpoint") -> None:
    """Check that ``path`` is a local Hugging Face model folder with a config and weights.

    Raises:
        CheckpointError: naming ``flag``, the folder and what is missing.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{flag} {path}: no such folder (download the model there, e.g. `hf download <repo> --local-dir {path}`)")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{flag} {path}: config.json is missing; this is not a Hugging Face model folder")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise CheckpointError(f"{flag} {path}: no weights (*.safetensors or *.bin) in the folder")


def weights_bytes(path: str | os.PathLike) -> int:
    """Total size in bytes of the weight files (``*.safetensors``, ``*.bin``) of a Hugging Face folder."""
    folder = Path(path)
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern))


def explain_write_failure(folder: str | os.PathLike, needed_bytes: int, error: BaseException) -> BaseException:
    """The error to raise when writing ``needed_bytes`` of checkpoint into ``folder`` failed with ``error``.

    torch's writers report a full disk as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``
    (or inside a ``CheckpointException``), which names neither the disk nor the size.  When ``folder``'s file
    system has less than ``needed_bytes`` free now, this returns a :class:`CheckpointError` that says so (free and
    needed GiB, the folder, what to do), chained to ``error``; otherwise ``error`` itself.

    Args:
        folder: where the checkpoint was being written (an existing folder or one below an existing one).
        needed_bytes: bytes this writer was writing, > 0.
        error: what the writer raised.
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
