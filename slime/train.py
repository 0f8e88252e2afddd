"""The command line of a GRPO run: ``python -m slime.train [flags]`` (``--help`` lists them by group).

It parses and checks the flags (:mod:`slime.arguments`), claims the run's folders, writes
``command.sh`` and runs :func:`slime.driver.train`; the run's modules (Ray, torch, engines,
trainers) are imported only once the flags are good.

Exit status of ``python -m slime.train``: 0 when the run finished; 1 when it stopped with an
error after its first rollout step began (``slime: error: ...``; resume it with ``--load``);
:data:`EXIT_NOT_STARTED` (2, as for a usage error) when it stopped with an error before that
(flags, a refused folder, the data, ``--load``, engines that did not start): nothing of it
to resume, so fix the error and run the same command again; ``128 + N`` on signal ``N``.
The geo3k launcher prints its resume line only when the status is not 2.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import shlex
import signal
import sys
from pathlib import Path

from slime.arguments import parse_args
from slime.checkpoints.layout import check_not_a_file
from slime.errors import SlimeError
from slime.utils.lifetime import watch_parent
from slime.utils.run_lock import claim_run_dirs

EXIT_NOT_STARTED = 2
"""Exit status of a run that stopped with an error before its first rollout step (module docstring)."""
COMMAND_FILE = "command.sh"
"""In ``--output-dir``: the command that started the run, written once the run holds its folders."""


def main(argv: list[str] | None = None) -> None:
    """``python -m slime.train [flags]``; see the module docstring for the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_args(argv)
    import torch

    from slime import driver  # Ray, torch, the engines and trainers: imported once the flags are good

    parent = watch_parent(cfg.logging.parent_pid)  # started below, around the run
    started = []  # [True] once the first rollout step begins
    failure = None  # the message of an error this reports, once the except clause has let go of it

    try:
        if cfg.run_mode.check_only:
            components = driver.resolve_components(cfg)
            check_not_a_file(cfg.checkpoint.load)  # as the run's folder claim does: a file would start it fresh
            if not torch.cuda.is_available():  # as the set-up of a run without GPUs does
                driver.check_cpu_run(cfg)
            print(f"slime: flags OK (engine {components.engine_cls.__name__}, trainer {components.backend_cls.__name__})")
            return
        # One writer per --output-dir / --save; the run stops when --parent-pid exits.
        with claim_run_dirs(driver.make_run_dir(cfg), cfg.checkpoint.save, cfg.checkpoint.load,
                            overwrite=cfg.logging.overwrite_output_dir,
                            checkpoint_parts=cfg.train_backend_config.checkpoint_parts()), parent, _sigterm_raises():
            write_command(driver.make_run_dir(cfg), argv)
            driver.train(cfg, on_start=lambda: started.append(True))
    except KeyboardInterrupt:
        if not parent.fired.is_set():
            raise
        failure = (f"the launcher (--parent-pid {parent.pid}) exited, so the run stopped"
                   + ("; resume it with --load" if started else ""))
    except SlimeError as e:  # every user-facing error (slime.errors); anything else keeps its traceback
        failure = _message(e)
    _release_run()
    if failure is not None:  # out of the except clause: the SystemExit does not carry the error and its frames
        _fail(failure, started=bool(started))


def _release_run() -> None:
    """Free what the run left in reference cycles (Ray actor handles among them) now, while Ray is still as the run
    left it, rather than in the interpreter's last collection at exit, where ``ActorHandle.__del__`` meets Ray torn
    down and prints an "Exception ignored" traceback."""
    gc.collect()


def _message(error: SlimeError) -> str:
    """``error``'s message; for one raised in a Ray actor (``ray.get`` raises a ``RayTaskError`` that subclasses the
    original's class, whose text is Ray's header and the remote traceback) the original's message."""
    cause = getattr(error, "cause", None)
    return str(cause if isinstance(cause, SlimeError) else error)


def _fail(message: str, *, started: bool) -> None:
    """Print ``slime: error: <message>`` to stderr and exit: status 1 once the run's first step
    began, :data:`EXIT_NOT_STARTED` before."""
    print(f"slime: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1 if started else EXIT_NOT_STARTED)


def write_command(run_dir: Path, argv: list[str]) -> Path:
    """Write ``run_dir/command.sh``: this interpreter, ``-m slime.train`` and ``argv`` without
    ``--parent-pid`` (so that it can be re-run from a shell, e.g. under ``nohup``).

    Called once the run holds its folders' locks, so only the run that owns ``run_dir`` writes it.
    """
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--parent-pid":
            skip = True
        elif not arg.startswith("--parent-pid="):
            kept.append(arg)
    path = run_dir / COMMAND_FILE
    path.write_text(shlex.join([sys.executable, "-m", "slime.train", *kept]) + "\n")
    return path


@contextlib.contextmanager
def _sigterm_raises():
    """Turn the first SIGTERM (the launcher's stop, a cluster scheduler's cancel) into ``SystemExit(143)``,
    so that :func:`train` stops its engines and trainers on the way out; a second SIGTERM kills at once."""

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main(sys.argv[1:])
