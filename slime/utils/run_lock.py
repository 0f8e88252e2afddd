"""One writer per run directory and per checkpoint folder.

:func:`claim_run_dirs` locks ``--output-dir`` and ``--save`` (``.slime.lock``, ``flock``, held for the
whole run and dropped by the kernel however the process exits; the file records the holder) and
refuses a folder that holds results this run would mix with or lose.  A used ``--output-dir``
(non-empty ``metrics.jsonl``) is allowed when (a) ``--load`` holds a complete checkpoint (the
records logged after it are dropped), (b) ``--save D --load D`` restarts the run of that folder,
which saved to ``D`` and stopped before its first checkpoint (its records are dropped), or (c)
``--overwrite-output-dir`` deletes its files first.  A ``--save`` with checkpoints is allowed when
``--load`` is the same folder, or deleted with ``--overwrite-output-dir`` (refused when ``--load`` is it).
Every deletion is logged.  The rules and why: ``docs/design/run_lifetime.md``.

``python -m slime.utils.run_lock [driver flags]`` runs the same checks without locking or deleting
(the launcher calls it before it starts the driver).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Sequence

from slime.checkpoints import layout as ckpt
from slime.errors import SlimeError
from slime.utils.timer import phase_key

logger = logging.getLogger(__name__)

LOCK_FILE = ".slime.lock"
METRICS_FILE = "metrics.jsonl"  # slime.utils.metrics.METRICS_FILE, kept here so the CLI imports nothing heavy
RUN_FILES = (METRICS_FILE, "reward_curve.png", "wandb_run.json")
"""What ``--overwrite-output-dir`` deletes from the run directory (the files a run writes there)."""
RESTART_FILES = (METRICS_FILE, "reward_curve.png")
"""What a restart of a run that stopped before its first checkpoint deletes (2b); the wandb run id stays."""
SAVE_METRIC = phase_key("save")
"""``perf/save_time_s``: in the metrics record of every step that saved a checkpoint (:mod:`slime.driver`)."""
_READ_HOLDER_ATTEMPTS = 20
"""Reads of a just-locked lock file before giving up on its holder's record (its writer may lag)."""


class RunDirError(SlimeError, ValueError):
    """An ``--output-dir`` or ``--save`` folder cannot be used by this run; the message names the flag, the
    folder, why (the other run's PID, or what the folder holds) and the fix.
    """


@dataclasses.dataclass
class _Folder:
    """A folder of the run, the flag that names it, and which results this run writes there."""

    flag: str
    path: Path
    metrics: bool
    """The run directory (``--output-dir``): metrics, plot, wandb run id."""
    checkpoints: bool
    """The checkpoint folder (``--save``)."""
    previous: dict | None = None
    """The record of the folder's last lock holder (the run whose results are there), if readable."""


class RunDirClaim:
    """The locks of one run on its folders; :meth:`release` (or leaving the ``with`` block) drops them."""

    def __init__(self, fds: list[int]):
        self._fds = fds

    def release(self) -> None:
        """Unlock and close every lock file (idempotent); the files keep the last holder's record."""
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "RunDirClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_run_dirs(
    output_dir: str | os.PathLike,
    save: str | os.PathLike | None,
    load: str | os.PathLike | None,
    *,
    overwrite: bool = False,
    command: list[str] | None = None,
    checkpoint_parts: Sequence[str] = (),
) -> RunDirClaim:
    """Lock ``--output-dir`` and ``--save`` (created if missing), refuse folders that hold another run's
    results, and with ``overwrite`` delete those results.

    ``command`` is recorded in the lock files (default ``sys.argv``); ``checkpoint_parts`` are the
    backend's parts (:meth:`slime.backends.config.BackendConfig.checkpoint_parts`) that a ``--load``
    checkpoint must hold to resume a used ``--output-dir``.  Keep the returned claim for the whole run.

    Raises:
        RunDirError: a folder is locked by a live run (naming its PID and host), or holds results this
            run would mix with or lose.
        CheckpointError: ``--load`` is a file (before any folder is created), or a used ``--output-dir`` is to be
            resumed from a ``--load`` whose latest checkpoint is malformed or incomplete.
    """
    ckpt.check_not_a_file(load)
    folders = _folders(output_dir, save)
    record = {
        "pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": shlex.join(sys.argv if command is None else command), "save": _resolved(save),
    }  # fmt: skip
    fds: list[int] = []
    previous_texts: list[str] = []
    try:
        for folder in folders:
            folder.path.mkdir(parents=True, exist_ok=True)
            fd = _lock(folder)
            fds.append(fd)
            previous_texts.append(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            folder.previous = _parse_record(previous_texts[-1])
            _write(fd, json.dumps(record) + "\n")  # at once, so that a refused rival names this run
        restarts = _check_reuse(folders, save, load, overwrite, checkpoint_parts)
        if overwrite:
            _delete_results(folders, RUN_FILES, "--overwrite-output-dir")
        for folder in restarts:
            logger.warning("--output-dir %s: restarting its run, which stopped before its first checkpoint (--save %s "
                           "--load %s holds none): dropping its %d metrics records", folder.path, save, load,
                           len(_metrics_records(folder.path)))  # fmt: skip
            _delete_results([folder], RESTART_FILES, "restart")
    except BaseException:
        for fd, text in zip(fds, previous_texts):  # a refused run leaves the record of the folder's run
            _write(fd, text)
        RunDirClaim(fds).release()
        raise
    return RunDirClaim(fds)


def check_run_dirs(
    output_dir: str | os.PathLike, save: str | os.PathLike | None, load: str | os.PathLike | None, *, overwrite: bool
) -> None:
    """The checks of :func:`claim_run_dirs` without locking, creating or deleting (of ``--load``: the driver's part).

    Raises:
        RunDirError, CheckpointError: as :func:`claim_run_dirs` would.
    """
    ckpt.check_not_a_file(load)
    folders = [f for f in _folders(output_dir, save) if f.path.is_dir()]
    for folder in folders:
        lock_file = folder.path / LOCK_FILE
        if lock_file.exists():
            fd = _lock(folder)
            try:
                folder.previous = _parse_record(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
            finally:
                os.close(fd)
    _check_reuse(folders, save, load, overwrite, ())


def _folders(output_dir: str | os.PathLike, save: str | os.PathLike | None) -> list[_Folder]:
    if save is not None and _same(save, output_dir):
        return [_Folder("--output-dir", Path(output_dir), metrics=True, checkpoints=True)]
    folders = [_Folder("--output-dir", Path(output_dir), metrics=True, checkpoints=False)]
    if save is not None:
        folders.append(_Folder("--save", Path(save), metrics=False, checkpoints=True))
    return folders


def _same(a: str | os.PathLike, b: str | os.PathLike | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def _resolved(path: str | os.PathLike | None) -> str | None:
    return None if path is None else os.path.realpath(path)


def _lock(folder: _Folder) -> int:
    """Open and lock ``folder/.slime.lock``.

    Raises:
        RunDirError: another process holds the lock.
    """
    path = folder.path / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirError(
            f"{folder.flag} {folder.path} is in use by another slime run ({holder}); a folder has one writer at a "
            f"time. Wait for that run to end (or stop it: kill {_pid_hint(holder)}), or choose another {folder.flag}"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _parse_record(text: str) -> dict | None:
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _read_holder(fd: int) -> str:
    for _ in range(_READ_HOLDER_ATTEMPTS):
        text = os.pread(fd, 1 << 16, 0).decode(errors="replace").strip()
        if text:
            break
        time.sleep(0.05)  # the holder locks first, then writes its record
    try:
        record = json.loads(text)
        words = f"pid {record['pid']} on host {record['host']}, started {record['started']}"
        return words + (f", running: {record['command'][:300]}" if record.get("command") else "")
    except (ValueError, KeyError, TypeError):
        return f"pid unknown: its lock file holds {text[:200]!r}"


def _pid_hint(holder: str) -> str:
    return holder.split()[1] if holder.startswith("pid ") and holder.split()[1].isdigit() else "<pid>"


def _metrics_records(folder: Path) -> list[dict | None]:
    path = folder / METRICS_FILE
    if not path.is_file():
        return []
    with path.open("rb") as f:
        return [_parse_record(line.decode(errors="replace")) for line in f if line.strip()]


def _checkpoints(folder: Path) -> list[Path]:
    entries = sorted(folder.glob("iter_*"))
    marker = folder / ckpt.LATEST_FILE
    return entries + ([marker] if marker.exists() else [])


def _check_reuse(
    folders: list[_Folder],
    save: str | os.PathLike | None,
    load: str | os.PathLike | None,
    overwrite: bool,
    checkpoint_parts: Sequence[str],
) -> list[_Folder]:
    """Refuse folders that hold results of a run this one neither resumes nor overwrites; return those to restart (b).
    """
    restarts = []
    for folder in folders:
        records = _metrics_records(folder.path) if folder.metrics and not overwrite else []
        if records:
            where = f"{folder.flag} {folder.path} already holds the metrics of a run ({folder.path / METRICS_FILE}, " \
                    f"{len(records)} records)"  # fmt: skip
            if load is None:
                raise RunDirError(
                    f"{where}. Resume that run with --load <its --save folder>, start over in this folder "
                    f"with --overwrite-output-dir (deletes its metrics and checkpoints), or choose another {folder.flag}"
                )
            latest = ckpt.latest_iteration(load) if Path(load).is_dir() else None
            if latest is not None:
                ckpt.check_complete(load, latest, checkpoint_parts)  # a resume: the driver drops the later records
            elif _restarts_unsaved_run(folder, records, save, load):
                restarts.append(folder)
            else:
                raise RunDirError(f"{where}, and --load {load} {_why_no_resume(folder, records, save, load)}, so "
                                  f"this run would start at rollout 0 over that run's records. Point --load at the "
                                  f"--save folder of that run to resume it, start over in this folder with "
                                  f"--overwrite-output-dir (deletes its metrics and checkpoints), or choose another "
                                  f"{folder.flag}")  # fmt: skip
        checkpoints = _checkpoints(folder.path) if folder.checkpoints else []
        if not checkpoints:
            continue
        resumed = _same(folder.path, load)
        if resumed and overwrite:
            raise RunDirError(
                f"--overwrite-output-dir would delete the checkpoints in {folder.flag} {folder.path} that --load "
                f"{load} resumes from; drop --overwrite-output-dir to resume, or --load to start over"
            )
        if not resumed and not overwrite:
            names = ", ".join(p.name for p in checkpoints[:4]) + (", ..." if len(checkpoints) > 4 else "")
            raise RunDirError(
                f"{folder.flag} {folder.path} already holds checkpoints ({names}). Resume from them with --load "
                f"{folder.path}, start over with --overwrite-output-dir (deletes them), or choose another --save"
            )
    return restarts


def _restarts_unsaved_run(
    folder: _Folder, records: list[dict | None], save: str | os.PathLike | None, load: str | os.PathLike
) -> bool:
    """Whether ``--save D --load D`` restarts the run of ``folder``: it saved to ``D`` and none of its steps saved."""
    return (
        save is not None and _same(save, load) and folder.previous is not None
        and folder.previous.get("save") == _resolved(save)
        and all(record is not None and SAVE_METRIC not in record for record in records)
    )  # fmt: skip


def _why_no_resume(folder: _Folder, records: list[dict | None], save, load) -> str:
    state = "does not exist" if not Path(load).exists() else "holds no checkpoint"
    previous_save = (folder.previous or {}).get("save", False)
    if save is None or not _same(save, load):
        return f"{state} (it is not this run's --save either)"
    if previous_save is False:
        return f"{state}, and which --save the run in this folder used is unknown ({folder.path / LOCK_FILE})"
    if previous_save != _resolved(save):
        return f"{state}, and the run in this folder saved to --save {previous_save}, not to {save}"
    return (f"{state}, but the run in this folder saved checkpoints (records with {SAVE_METRIC}) that are gone "
            "from it")  # fmt: skip


def _delete_results(folders: list[_Folder], run_files: Sequence[str], why: str) -> None:
    """Delete a previous run's ``run_files`` (and, for :data:`RUN_FILES`, the checkpoints), logging each with ``why``.
    """
    for folder in folders:
        doomed = [folder.path / name for name in run_files if folder.metrics and (folder.path / name).exists()]
        if folder.checkpoints and run_files is RUN_FILES:
            doomed += _checkpoints(folder.path)
        for path in doomed:
            logger.warning("%s: deleting %s", why, path)
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def main(argv: list[str] | None = None) -> None:
    """``python -m slime.utils.run_lock [driver flags]``: the launcher's folder probe before anything starts.

    Exits 0 when the folders are usable; 2 with ``slime: error: <refusal>`` on stderr when they are not, as the driver
    does for the same refusal (nothing ran: the status of every error before a run's first step); 2 with argparse's
    usage for a malformed command line (no ``--output-dir``)."""
    parser = argparse.ArgumentParser(prog="python -m slime.utils.run_lock", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--overwrite-output-dir", action=argparse.BooleanOptionalAction, default=False)
    args, _ = parser.parse_known_args(argv)
    try:
        check_run_dirs(args.output_dir, args.save, args.load, overwrite=args.overwrite_output_dir)
    except (RunDirError, ckpt.CheckpointError) as e:
        print(f"slime: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
