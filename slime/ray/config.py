"""Cluster flags (MISC_ARGS): how many GPUs train, how many generate, and whether they are shared.

On a machine without GPUs the same numbers size CPU bundles: ``--actor-num-gpus-per-node 2``
means two trainer ranks (processes), and ``--rollout-num-gpus 1`` one rollout engine process.
"""

from __future__ import annotations

import dataclasses

from slime.utils.config import ConfigError, check_at_least_one, flag


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
