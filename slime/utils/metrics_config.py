"""Run flags of observability: the run directory and logging (part of MISC_ARGS) and wandb (WANDB_ARGS).

Read by :mod:`slime.utils.metrics` and the driver; importable without tqdm, wandb or matplotlib.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from slime.utils.config import ConfigError, flag

logger = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")
"""The values of ``--wandb-mode`` and ``$WANDB_MODE``."""


@dataclasses.dataclass
class WandbConfig:
    """Weights & Biases (WANDB_ARGS). Metrics always go to <output-dir>/metrics.jsonl too.

    The mode: :func:`slime.utils.metrics.resolve_wandb_mode`.
    """

    use_wandb: bool = flag(False, help="Also log metrics to wandb (offline mode when no API key is set).")
    wandb_project: str = flag("slime", help="wandb project.")
    wandb_group: str | None = flag(None, help="wandb group (default: the run name, without the random suffix).")
    wandb_key: str | None = flag(None, help="wandb API key (default: $WANDB_API_KEY); without one wandb runs offline.")
    wandb_host: str | None = flag(
        None, help="wandb server URL for self-hosted wandb, e.g. https://wandb.example.com (default: $WANDB_BASE_URL)."
    )
    wandb_mode: str | None = flag(
        None,
        choices=list(WANDB_MODES),
        help="Force a wandb mode (default: $WANDB_MODE, else online with an API key, else offline).",
    )
    disable_wandb_random_suffix: bool = flag(
        False, help="Use the run name as the wandb run name as is, without a random 6-character suffix."
    )

    def __post_init__(self):
        if not self.wandb_project or not self.wandb_project.strip():
            raise ConfigError(f"--wandb-project must be a non-empty name, got {self.wandb_project!r}")
        if self.wandb_host is not None and not self.wandb_host.startswith(("http://", "https://")):
            raise ConfigError(
                f"--wandb-host must be a URL starting with http:// or https://, got {self.wandb_host!r}"
            )


@dataclasses.dataclass
class LoggingConfig:
    """Run directory, logging, check-only mode and the run's lifetime (part of MISC_ARGS)."""

    output_dir: str | None = flag(
        None, help="Run directory for metrics.jsonl, reward_curve.png and logs (default: outputs/<run-name>)."
    )
    run_name: str | None = flag(None, help="Name of the run (default: slime-<timestamp>).")
    save_debug_rollout_data: str | None = flag(
        None, metavar="PATH",
        help="Write every rollout's samples (prompt index, response, reward, advantage, status, whether it is in "
        "the loss, ...) to this path; it may contain '{rollout_id}', e.g. /tmp/rollout_{rollout_id}.jsonl. Beside "
        "it goes the same path with the suffix .pt: every field the trainers read, for --load-debug-rollout-data.",
    )
    load_debug_rollout_data: str | None = flag(
        None, metavar="DIR_OR_PATH",
        help="Train on rollouts saved by --save-debug-rollout-data instead of generating: no rollout engine starts "
        "(also on CPU), no weight sync, no eval; implies --debug-train-only. Give the folder of the saved files "
        "(rollout k is <DIR>/rollout_{k}.pt) or the --save-debug-rollout-data path itself. A missing file, or one "
        "saved from another model, tokenizer or batch shape, is an error naming it.",
    )
    debug_train_only: bool = flag(
        False, help="Run the trainers only, on --load-debug-rollout-data (which it needs; upstream slime's flag)."
    )
    debug_rollout_only: bool = flag(
        False,
        help="Run rollouts, rewards and eval only: no trainer starts, no training step, no weight sync, no "
        "checkpoint (the engines keep --hf-checkpoint's weights). With --save-debug-rollout-data the rollouts are "
        "saved for a later --load-debug-rollout-data.",
    )
    no_progress_bar: bool = flag(False, help="Disable the progress bar over rollout steps (e.g. for log files).")
    check_only: bool = flag(
        False,
        help="Parse and validate the flags and check that --rollout-backend and --train-backend can be imported "
        "here, then exit (0 = OK); reads no data or checkpoint, so it can run before a model is downloaded.",
    )
    overwrite_output_dir: bool = flag(
        False,
        help="Start from scratch in an --output-dir / --save folder that holds an earlier run: its metrics.jsonl, "
        "reward_curve.png and wandb_run.json, and the checkpoints in --save (iter_*, "
        "latest_checkpointed_iteration.txt), are deleted first, each one logged. Without it such a folder is "
        "refused unless --load resumes the run. A folder in use by a live run is always refused.",
    )
    parent_pid: int | None = flag(
        None,
        metavar="PID",
        help="Stop the run within seconds when process PID exits, however it dies (SIGKILL included): the engines, "
        "trainers and the Ray instance the run started are shut down and no checkpoint is written after that. "
        "The geo3k launcher passes its own PID. Default: the run outlives its parent (e.g. under nohup).",
    )

    def __post_init__(self):
        if self.output_dir is not None and not self.output_dir.strip():
            raise ConfigError("--output-dir must be a folder, got an empty string; give one, or drop --output-dir")
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ConfigError(f"--parent-pid must be a process id >= 1, got {self.parent_pid}")
        if self.load_debug_rollout_data is not None:
            if not self.load_debug_rollout_data.strip():
                raise ConfigError("--load-debug-rollout-data must be a folder or a path, got an empty string")
            self.debug_train_only = True  # as upstream slime
        if self.debug_train_only and self.debug_rollout_only:
            raise ConfigError("--debug-rollout-only cannot go with --debug-train-only / --load-debug-rollout-data: "
                              "give one of them")
        if self.debug_train_only and self.load_debug_rollout_data is None:
            raise ConfigError("--debug-train-only needs --load-debug-rollout-data (the saved rollouts to train on); "
                              "save them first with --save-debug-rollout-data")
        if self.save_debug_rollout_data is not None:
            if not self.save_debug_rollout_data.strip():
                raise ConfigError("--save-debug-rollout-data must be a non-empty path")
            if self.load_debug_rollout_data is not None:
                raise ConfigError("--save-debug-rollout-data writes generated rollouts, and --load-debug-rollout-data "
                                  "generates none (it trains on saved ones): drop --save-debug-rollout-data")
            if self.save_debug_rollout_data.endswith(".pt"):
                raise ConfigError(f"--save-debug-rollout-data {self.save_debug_rollout_data!r}: give the JSONL "
                                  "summary's path (e.g. .../rollout_{rollout_id}.jsonl); the replayable .pt record "
                                  "goes beside it")
            try:
                self.save_debug_rollout_data.format(rollout_id=0)
            except (KeyError, IndexError, ValueError) as e:
                raise ConfigError(
                    f"--save-debug-rollout-data {self.save_debug_rollout_data!r}: the only placeholder allowed is "
                    f"{{rollout_id}} ({type(e).__name__}: {e}); double other braces"
                ) from None
            if "{rollout_id}" in Path(self.save_debug_rollout_data).suffix:
                raise ConfigError(
                    f"--save-debug-rollout-data {self.save_debug_rollout_data!r}: {{rollout_id}} is in the file's "
                    "suffix, which the replayable record beside it replaces with .pt (every rollout would write the "
                    "same record); put it before the suffix, e.g. rollout_{rollout_id}.jsonl"
                )
            if "{rollout_id}" not in self.save_debug_rollout_data:
                logger.warning("--save-debug-rollout-data %s has no {rollout_id}: every rollout overwrites the "
                               "previous one's files (as upstream); only the last is kept",
                               self.save_debug_rollout_data)
