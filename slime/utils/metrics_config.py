"""Run flags of observability: the run directory and logging (part of MISC_ARGS) and wandb (WANDB_ARGS).

Read by :mod:`slime.utils.metrics` and the driver; importable without tqdm, wandb or matplotlib.
"""

from __future__ import annotations

import dataclasses
import logging

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
    """Run directory, logging and the run's lifetime (part of MISC_ARGS; the run mode is
    :class:`slime.ray.config.RunModeConfig`)."""

    output_dir: str | None = flag(
        None, help="Run directory for metrics.jsonl, reward_curve.png and logs (default: outputs/<run-name>)."
    )
    run_name: str | None = flag(None, help="Name of the run (default: slime-<timestamp>).")
    no_progress_bar: bool = flag(False, help="Disable the progress bar over rollout steps (e.g. for log files).")
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
