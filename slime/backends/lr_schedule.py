"""Learning-rate schedule of every backend: linear warm-up, then constant, linear or cosine decay to a floor.

A pure function of the optimizer-step index (a backend keeps only the steps taken), after Megatron-LM's
``OptimizerParamScheduler.get_lr`` (upstream slime's).  With ``W`` warm-up steps, horizon ``D`` and
``progress = (s - W) / (D - W)``, step ``s`` gets:

- ``s < W``: ``lr * (s + 1) / W`` (Megatron: ``lr * s / W``; why: ``docs/design/training_step.md``);
- ``constant``: ``lr``; ``linear``: ``min_lr + (lr - min_lr) * (1 - progress)``;
- ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``; linear / cosine at ``s >= D``: ``min_lr``.
"""

from __future__ import annotations

import dataclasses
import math

from slime.utils.config import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """Learning rate as a function of the optimizer-step index (module docstring): peak ``lr`` (``--lr``, > 0), floor
    ``min_lr`` (``--min-lr``, in ``[0, lr]``), ``decay_style`` (``--lr-decay-style``), ``warmup_steps`` ``W``
    (``--lr-warmup-iters``, >= 0) and ``decay_steps`` ``D`` (``--lr-decay-iters``, counted from step 0, ``> W`` for
    linear / cosine, unused for constant), in optimizer steps; ``ConfigError`` (naming the flag and the fix) otherwise.
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
    def from_config(cls, cfg, total_steps: int | None) -> LRSchedule:
        """From an :class:`slime.backends.config.OptimizerConfig`; ``total_steps`` (the run's optimizer steps, None when
        unknown) is the decay length without ``--lr-decay-iters``.  ``ConfigError``: see the class docstring."""
        return cls(
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            decay_style=cfg.lr_decay_style,
            warmup_steps=cfg.lr_warmup_iters,
            decay_steps=cfg.lr_decay_iters if cfg.lr_decay_iters is not None else total_steps,
        )

    def __call__(self, step: int) -> float:
        """The rate of optimizer step ``step`` (0: the run's first); ``ValueError`` when ``step < 0``."""
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
