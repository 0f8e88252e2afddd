"""Run observability: metrics JSONL, wandb, progress bar and the reward-curve plot.

(To be completed: MetricsLogger.)
"""

from __future__ import annotations

import dataclasses

from slime.utils.config import ConfigError, flag


@dataclasses.dataclass
class WandbConfig:
    """Weights & Biases (WANDB_ARGS). Metrics always go to <output-dir>/metrics.jsonl too."""

    use_wandb: bool = flag(False, help="Also log metrics to wandb (offline mode when no API key is set).")
    wandb_project: str = flag("slime", help="wandb project.")
    wandb_group: str | None = flag(None, help="wandb group (default: the run name).")
    wandb_key: str | None = flag(None, help="wandb API key (default: $WANDB_API_KEY); without one wandb runs offline.")
    wandb_host: str | None = flag(None, help="wandb server URL for self-hosted wandb.")
    wandb_mode: str | None = flag(
        None, choices=["online", "offline", "disabled"], help="Force a wandb mode (default: online with a key, else offline)."
    )
    disable_wandb_random_suffix: bool = flag(False, help="Use the run name as is, without a random suffix.")


@dataclasses.dataclass
class LoggingConfig:
    """Run directory and logging (part of MISC_ARGS)."""

    output_dir: str | None = flag(
        None, help="Run directory for metrics.jsonl, reward_curve.png and logs (default: outputs/<run-name>)."
    )
    run_name: str | None = flag(None, help="Name of the run (default: slime-<timestamp>).")
    save_debug_rollout_data: str | None = flag(
        None,
        help="Write every rollout's samples (prompt index, response, reward, ...) to this path; it may contain "
        "'{rollout_id}', e.g. /tmp/rollout_{rollout_id}.jsonl.",
    )
    no_progress_bar: bool = flag(False, help="Disable the progress bar over rollout steps (e.g. for log files).")

    def __post_init__(self):
        if self.save_debug_rollout_data is not None and not self.save_debug_rollout_data.strip():
            raise ConfigError("--save-debug-rollout-data must be a non-empty path")
