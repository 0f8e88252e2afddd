"""Learning-rate schedule shared by the training backends: linear warm-up, then constant,
linear or cosine decay to a floor.

The schedule is a pure function of the optimizer-step index, so a backend only keeps the
number of steps taken (its "scheduler state"); the training step
(:meth:`slime.backends.base.TrainerBackend.train`) asks it for the rate of every step.

What it follows: Megatron-LM's ``OptimizerParamScheduler.get_lr`` (``--lr``,
``--min-lr``, ``--lr-decay-style``, ``--lr-warmup-iters``, ``--lr-decay-iters``), which
upstream slime inherits.  With ``W`` warm-up steps, decay horizon ``D`` and
``progress = (s - W) / (D - W)``:

- warm-up, ``s < W``: ``lr * (s + 1) / W``;
- ``constant`` after warm-up: ``lr``;
- ``linear``: ``min_lr + (lr - min_lr) * (1 - progress)``;
- ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``;
- ``s >= D``: ``min_lr`` (linear / cosine).

Where it departs: Megatron's warm-up gives ``lr * s / W`` (the run's first step at rate 0);
here step ``s`` uses ``lr * (s + 1) / W`` (why: ``docs/design/training_step.md``).
"""

from __future__ import annotations

import dataclasses
import math

from slime.utils.config import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the optimizer-step index (see the module docstring).

    Attributes:
        lr: peak rate (``--lr``), > 0.
        min_lr: floor of the decay (``--min-lr``), ``0 <= min_lr <= lr``.
        decay_style: ``constant``, ``linear`` or ``cosine`` (``--lr-decay-style``).
        warmup_steps: linear warm-up length ``W`` (``--lr-warmup-iters``), optimizer steps, >= 0.
        decay_steps: step ``D`` at which the decay reaches ``min_lr`` (``--lr-decay-iters``),
            counted from step 0 and including the warm-up; ``> W`` for linear / cosine,
            unused (may be None) for constant.

    Raises:
        ConfigError: a value is out of range; the message names the flag and the fix.
    """

    lr: float
    min_lr: float = 0.0
    decay_style: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None

    def __post_init__(self):
        if self.decay_style not in DECAY_STYLES:
            raise ConfigError(
                f"--lr-decay-style {self.decay_style!r} is unknown; choose one of {', '.join(DECAY_STYLES)}"
            )
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min-lr must be in [0, --lr = {self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--lr-warmup-iters must be >= 0 optimizer steps, got {self.warmup_steps}")
        if self.decay_style != "constant":
            if self.decay_steps is None:
                raise ConfigError(
                    f"--lr-decay-style {self.decay_style} needs the decay length: give --lr-decay-iters "
                    "(optimizer steps), or --num-rollout so that it defaults to all steps of the run"
                )
            if self.decay_steps <= self.warmup_steps:
                raise ConfigError(
                    f"--lr-decay-iters {self.decay_steps} must exceed --lr-warmup-iters {self.warmup_steps} "
                    f"for --lr-decay-style {self.decay_style}; lengthen the decay or shorten the warm-up"
                )

    @classmethod
    def from_config(cls, cfg, total_steps: int | None) -> "LRSchedule":
        """Build the schedule from an :class:`slime.backends.config.OptimizerConfig`.

        Args:
            cfg: the optimizer flags (``lr``, ``min_lr``, ``lr_decay_style``,
                ``lr_warmup_iters``, ``lr_decay_iters``).
            total_steps: optimizer steps of the whole run (``num_rollout *
                num_steps_per_rollout``), the decay length when ``--lr-decay-iters`` is
                unset; None when unknown.

        Raises:
            ConfigError: see the class docstring.
        """
        return cls(
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            decay_style=cfg.lr_decay_style,
            warmup_steps=cfg.lr_warmup_iters,
            decay_steps=cfg.lr_decay_iters if cfg.lr_decay_iters is not None else total_steps,
        )

    def __call__(self, step: int) -> float:
        """The rate of optimizer step ``step`` (0 for the first step of the run).

        Raises:
            ValueError: ``step < 0``.
        """
        if step < 0:
            raise ValueError(f"optimizer step index must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.lr - self.min_lr)
