"""One writer per run directory and per checkpoint folder.

A run writes two folders: ``--output-dir`` (``metrics.jsonl``, ``reward_curve.png``,
``wandb_run.json``) and ``--save`` (``iter_*``, ``latest_checkpointed_iteration.txt``).
:func:`claim_run_dirs` makes sure nobody else writes them and that nothing in them is lost
silently:

1. **Exclusive lock.**  Each folder gets a lock file, ``.slime.lock``, locked with
   ``fcntl.flock(LOCK_EX | LOCK_NB)`` for the whole run.  The kernel drops the lock when the
   holder exits, however it exits (SIGKILL, OOM killer, a crash), so a stale lock file never
   blocks a later run.  The file holds the holder's PID, host, start time and command, which
   the refusal names.  The descriptor is not inherited by child processes (Python opens
   files non-inheritable, PEP 446), so Ray workers never hold the lock on the driver's behalf.
   On NFS, Linux emulates ``flock`` with byte-range locks, which NFSv4 servers keep across
   clients; Lustre needs its ``flock`` mount option.
2. **No silent reuse.**  A folder that already holds a run's results is refused unless the
   run resumes it or says to overwrite it:

   - ``--output-dir`` with a non-empty ``metrics.jsonl``: allowed with ``--load`` (the resume
     drops the records logged after its checkpoint, and says how many); with
     ``--overwrite-output-dir`` its ``metrics.jsonl``, ``reward_curve.png`` and
     ``wandb_run.json`` are deleted first.
   - ``--save`` with checkpoints (``iter_*`` folders or the marker file): allowed when
     ``--load`` is the same folder (resuming it); with ``--overwrite-output-dir`` the
     checkpoints are deleted first, which is refused when ``--load`` is that folder.

   Every deletion is logged with the path.

``python -m slime.utils.run_lock [driver flags]`` runs the same checks without locking or
deleting anything, on the ``--output-dir``, ``--save``, ``--load`` and
``--overwrite-output-dir`` of a full driver command line (other flags are ignored); the geo3k
launcher calls it before it writes ``command.sh`` into the run directory.
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

logger = logging.getLogger(__name__)

LOCK_FILE = ".slime.lock"
METRICS_FILE = "metrics.jsonl"  # slime.utils.metrics.METRICS_FILE, kept here so the CLI imports nothing heavy
RUN_FILES = (METRICS_FILE, "reward_curve.png", "wandb_run.json")
"""What ``--overwrite-output-dir`` deletes from the run directory (the files a run writes there)."""
CHECKPOINT_MARKER = "latest_checkpointed_iteration.txt"  # slime.utils.checkpoint.LATEST_FILE
_READ_HOLDER_ATTEMPTS = 20
"""Reads of a just-locked lock file before giving up on its holder's record (its writer may lag)."""


class RunDirError(ValueError):
    """An ``--output-dir`` or ``--save`` folder cannot be used by this run; the message names the
    flag, the folder, why (the other run's PID, or what the folder holds) and the fix."""


@dataclasses.dataclass
class _Folder:
    """A folder of the run, the flag that names it, and which results this run writes there."""

    flag: str
    path: Path
    metrics: bool
    """The run directory (``--output-dir``): metrics, plot, wandb run id."""
    checkpoints: bool
    """The checkpoint folder (``--save``)."""


class RunDirClaim:
    """The locks of one run on its folders; :meth:`release` (or leaving the ``with`` block) drops them.

    Process exit drops them too.  Built by :func:`claim_run_dirs`.
    """

    def __init__(self, fds: list[int]):
        self._fds = fds

    def release(self) -> None:
        """Unlock and close every lock file (idempotent); the files stay, with the last holder's record."""
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
) -> RunDirClaim:
    """Lock ``--output-dir`` and ``--save`` for this process, refuse folders that hold another
    run's results (see the module docstring), and with ``overwrite`` delete those results.

    Args:
        output_dir: ``--output-dir`` (created if missing).
        save: ``--save`` or None (created if missing).
        load: ``--load`` or None.
        overwrite: ``--overwrite-output-dir``.
        command: the command line recorded in the lock files (default: ``sys.argv``).

    Returns:
        The claim; keep it for the whole run and release it at the end.

    Raises:
        RunDirError: a folder is locked by a live run (the message names its PID and host), or
            holds results this run would mix with or lose.
    """
    folders = _folders(output_dir, save)
    fds: list[int] = []
    try:
        for folder in folders:
            folder.path.mkdir(parents=True, exist_ok=True)
            fds.append(_lock(folder, command))
        _check_reuse(folders, load, overwrite)
        if overwrite:
            _delete_results(folders)
    except BaseException:
        RunDirClaim(fds).release()
        raise
    return RunDirClaim(fds)


def check_run_dirs(
    output_dir: str | os.PathLike, save: str | os.PathLike | None, load: str | os.PathLike | None, *, overwrite: bool
) -> None:
    """The checks of :func:`claim_run_dirs` without taking the locks (only probing them), creating
    folders or deleting anything.

    Raises:
        RunDirError: as :func:`claim_run_dirs` would.
    """
    folders = [f for f in _folders(output_dir, save) if f.path.is_dir()]
    for folder in folders:
        lock_file = folder.path / LOCK_FILE
        if lock_file.exists():
            os.close(_lock(folder, None, probe=True))
    _check_reuse(folders, load, overwrite)


def _folders(output_dir: str | os.PathLike, save: str | os.PathLike | None) -> list[_Folder]:
    """The run's distinct folders (``--save`` equal to ``--output-dir`` is one folder, locked once)."""
    if save is not None and _same(save, output_dir):
        return [_Folder("--output-dir", Path(output_dir), metrics=True, checkpoints=True)]
    folders = [_Folder("--output-dir", Path(output_dir), metrics=True, checkpoints=False)]
    if save is not None:
        folders.append(_Folder("--save", Path(save), metrics=False, checkpoints=True))
    return folders


def _same(a: str | os.PathLike, b: str | os.PathLike | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def _lock(folder: _Folder, command: list[str] | None, *, probe: bool = False) -> int:
    """Open and lock ``folder/.slime.lock``; write this process's record into it unless ``probe``.

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
    if probe:
        return fd
    record = {
        "pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": shlex.join(sys.argv if command is None else command),
    }  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def _read_holder(fd: int) -> str:
    """The lock holder's record, as words: ``pid 1234 on host h, started ..., running: ...``."""
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


def _metrics_records(folder: Path) -> int:
    """Lines in ``folder/metrics.jsonl`` (0 when it is missing or empty)."""
    path = folder / METRICS_FILE
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _checkpoints(folder: Path) -> list[Path]:
    """The checkpoint entries of a ``--save`` folder: ``iter_*`` folders and the marker file."""
    entries = sorted(folder.glob("iter_*"))
    marker = folder / CHECKPOINT_MARKER
    return entries + ([marker] if marker.exists() else [])


def _check_reuse(folders: list[_Folder], load: str | os.PathLike | None, overwrite: bool) -> None:
    """Refuse folders that hold results of a run this one neither resumes nor overwrites."""
    for folder in folders:
        records = _metrics_records(folder.path) if folder.metrics else 0
        if records and load is None and not overwrite:
            raise RunDirError(
                f"{folder.flag} {folder.path} already holds the metrics of a run ({folder.path / METRICS_FILE}, "
                f"{records} records). Resume that run with --load <its --save folder>, start over in this folder "
                f"with --overwrite-output-dir (deletes its metrics and checkpoints), or choose another {folder.flag}"
            )
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


def _delete_results(folders: list[_Folder]) -> None:
    """``--overwrite-output-dir``: delete the previous run's files, logging each one."""
    for folder in folders:
        doomed = [folder.path / name for name in RUN_FILES if folder.metrics and (folder.path / name).exists()]
        doomed += _checkpoints(folder.path) if folder.checkpoints else []
        for path in doomed:
            logger.warning("--overwrite-output-dir: deleting %s", path)
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def main(argv: list[str] | None = None) -> None:
    """``python -m slime.utils.run_lock [driver flags]``: exit 1 with the refusal, 0 when the folders are usable."""
    parser = argparse.ArgumentParser(prog="python -m slime.utils.run_lock", allow_abbrev=False,
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--overwrite-output-dir", action=argparse.BooleanOptionalAction, default=False)
    args, _ = parser.parse_known_args(argv)
    try:
        check_run_dirs(args.output_dir, args.save, args.load, overwrite=args.overwrite_output_dir)
    except RunDirError as e:
        sys.exit(f"slime: error: {e}")


if __name__ == "__main__":
    main()
