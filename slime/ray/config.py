"""Cluster flags (MISC_ARGS): how many GPUs train, how many generate, and whether they are shared; and the run mode:
which workers a run starts (both, engines alone, trainers alone on saved rollouts) or whether it only checks its flags.

On a machine without GPUs the same numbers size CPU bundles: ``--actor-num-gpus-per-node 2``
means two trainer ranks (processes), and ``--rollout-num-gpus 1`` one rollout engine process.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from slime.utils.config import ConfigError, check_at_least_one, flag

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    """Cluster and seed (MISC_ARGS): trainer and rollout GPU counts, colocation, Ray cluster. CPU runs: GPUs = ranks."""

    actor_num_nodes: int = flag(1, help="Nodes for the trainer.")
    actor_num_gpus_per_node: int = flag(
        1,
        help="Trainer GPUs per node; trainer world size = actor_num_nodes * this. On a machine without GPUs it is "
        "the number of trainer ranks (CPU processes), e.g. 2 for two ranks.",
    )
    rollout_num_gpus: int | None = flag(
        None,
        help="GPUs for the rollout engines in total. With --colocate it defaults to (and must equal) the trainer "
        "GPUs; without --colocate it is required.",
    )
    rollout_num_gpus_per_engine: int = flag(
        1, help="GPUs per rollout engine (SGLang's tensor-parallel size); must divide --rollout-num-gpus."
    )
    colocate: bool = flag(
        False,
        help="Trainer and rollout engines share the same GPUs, each releasing its memory while the other runs.",
    )
    ray_address: str | None = flag(
        None, help="Join this running Ray cluster (e.g. 10.0.0.1:6379 or 'auto'); default: start a local one."
    )
    seed: int = flag(1234, help="Seed of the trainer (model init, dropout, data order on the trainer side).")

    def __post_init__(self):
        check_at_least_one(self, "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine")
        if self.colocate:
            if self.rollout_num_gpus is None:
                self.rollout_num_gpus = self.actor_num_gpus
            elif self.rollout_num_gpus != self.actor_num_gpus:
                raise ConfigError(
                    f"--colocate shares the trainer GPUs with the engines, so --rollout-num-gpus must equal "
                    f"--actor-num-nodes * --actor-num-gpus-per-node = {self.actor_num_nodes} * "
                    f"{self.actor_num_gpus_per_node} = {self.actor_num_gpus}, got {self.rollout_num_gpus}; "
                    "drop --rollout-num-gpus"
                )
        elif self.rollout_num_gpus is None:
            raise ConfigError(
                "--rollout-num-gpus is required without --colocate (the engines get their own GPUs); "
                "give it, or add --colocate to share the trainer GPUs"
            )
        check_at_least_one(self, "rollout_num_gpus")
        per_engine = self.rollout_num_gpus_per_engine
        if self.rollout_num_gpus % per_engine:
            raise ConfigError(
                f"--rollout-num-gpus {self.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                f"{per_engine}; use a multiple, e.g. {max(1, self.rollout_num_gpus // per_engine) * per_engine}"
            )

    @property
    def actor_num_gpus(self) -> int:
        """Trainer world size: ``actor_num_nodes * actor_num_gpus_per_node``."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_rollout_engines(self) -> int:
        """Rollout engines: ``rollout_num_gpus // rollout_num_gpus_per_engine``."""
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine

    @property
    def num_gpus_needed(self) -> int:
        """GPUs (or CPU bundles) the run occupies: the trainer's, plus the engines' unless colocated."""
        return self.actor_num_gpus + (0 if self.colocate else self.rollout_num_gpus)


@dataclasses.dataclass
class RunModeConfig:
    """The run mode (MISC_ARGS (run mode)): engines and trainers (the default), rollouts only, training on saved
    rollouts only, or a check of the flags; and where rollouts are saved for a later train-only replay."""

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
    check_only: bool = flag(
        False,
        help="Parse and validate the flags and check that --rollout-backend and --train-backend can be imported "
        "here, then exit (0 = OK); reads no data or checkpoint, so it can run before a model is downloaded.",
    )

    def __post_init__(self):
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
