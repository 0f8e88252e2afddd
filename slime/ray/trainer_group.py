"""The trainer ranks as one object: the driver calls methods, the group hides the ranks.

Each rank is a Ray actor (:class:`TrainerActor`) holding one backend
(:class:`slime.backends.step.StepBackend`), whose step is :func:`slime.backends.step.train_step`. Every group
method states how its input is split across ranks and how results are gathered:

- :meth:`TrainerGroup.train`: the rollout's samples are cut into optimizer steps of
  ``--global-batch-size`` samples, each step is split evenly over data-parallel ranks,
  and the (already all-reduced) metrics of rank 0 are returned.
- :meth:`TrainerGroup.update_weights`: every rank sends the weights it is the source of
  through the run's :class:`slime.weight_sync.base.WeightTransport`; the group checks that
  each tensor came from exactly one rank.
- the others (init, save, offload, onload) run on all ranks and wait for all.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import ray
import torch

from slime.backends.config import RankInfo
from slime.backends.step import LARGEST_OVER_RANKS, TRAINER_TOTAL_KEY, StepBackend, train_step
from slime.data.sample import Sample
from slime.ray.engine_group import RolloutEngineGroup
from slime.ray.placement import Placement, cpu_threads_per_actor, free_port, node_ip
from slime.utils.timer import sub_phase_key
from slime.weight_sync.base import WeightTransport

logger = logging.getLogger(__name__)


@ray.remote
class TrainerActor:
    """Ray actor around one backend rank: the training step, the parity check's log-probs, the weight push,
    checkpoints and the colocated memory hand-over (``backend.memory``)."""

    def __init__(self, backend_factory, rank_info: RankInfo, cpu_threads: int):
        if rank_info.device == "cpu":
            torch.set_num_threads(cpu_threads)
        logging.basicConfig(level=logging.INFO, format=f"[trainer {rank_info.rank}] %(levelname)s %(name)s: %(message)s")
        self.rank_info = rank_info
        self.backend: StepBackend = backend_factory(rank_info)
        self.transport: WeightTransport | None = None
        self.engines: Sequence = ()

    def init(self) -> tuple[int, int, int, list[str]]:
        """Build the backend. Returns (next rollout id, data-parallel rank, data-parallel size, the frozen
        checkpoint names of every rank)."""
        start = self.backend.init()
        return start, self.backend.dp.rank, self.backend.dp.size, sorted(getattr(self.backend, "frozen_hf_names", ()))

    def train(self, rollout_id: int, samples: list[Sample], num_steps: int) -> dict[str, float]:
        """:func:`slime.backends.step.train_step` on this rank's samples."""
        return train_step(self.backend, rollout_id, samples, num_steps)

    def compute_log_probs(self, samples: list[Sample], rounding_noise: bool = False,
                          replay_routes: bool = False) -> list[list[float]]:
        return self.backend.compute_log_probs(samples, rounding_noise=rounding_noise, replay_routes=replay_routes)

    def connect_weights(self, transport: WeightTransport, engines: Sequence) -> None:
        """Keep this run's transport and the engine handles; its trainer-side set-up (once per run)."""
        self.transport, self.engines = transport, list(engines)
        transport.connect_rank(self.rank_info, self.engines)

    def send_weights(self, skip_frozen: bool = False) -> list[str]:
        """Send the weights this rank is the source of into every engine (``skip_frozen``: not the frozen ones);
        returns their names.

        If the transport fails part-way, the rest of the buckets are still drawn, so that this
        rank keeps taking part in the other ranks' gathers and they fail or finish instead of
        waiting for it forever; then the error is raised.
        """
        if self.transport is None:
            raise RuntimeError("send_weights before connect_weights: the trainer group connects the transport first")
        extra = {"skip_frozen": True} if skip_frozen else {}  # a backend that freezes nothing need not take it
        buckets = self.backend.iter_weight_buckets(self.transport.bucket_bytes, device=self.transport.tensor_device,
                                                   **extra)
        try:
            return self.transport.send(buckets, self.rank_info, self.engines)
        except BaseException:
            collections.deque(buckets, maxlen=0)
            raise

    def save(self, rollout_id: int, path: str) -> None:
        self.backend.save(rollout_id, Path(path))

    def offload(self, keep_weights: bool = False) -> None:
        self.backend.memory.offload(keep_weights)

    def onload(self, weights_only: bool = False) -> None:
        self.backend.memory.onload(weights_only)


class TrainerGroup:
    """All trainer ranks of one run.

    Args:
        placement: where the ranks go (one bundle each).
        backend_factory: picklable callable ``RankInfo -> StepBackend`` (the backend class with its
            :class:`~slime.backends.config.TrainerSpec` and own flag group bound, as
            :func:`slime.driver.start_workers` makes it).
        global_batch_size: samples per optimizer step (``--global-batch-size``).
        transport: how weights reach the engines, chosen once per run
            (:func:`slime.weight_sync.make_transport`).
    """

    def __init__(self, placement: Placement, backend_factory, global_batch_size: int, transport: WeightTransport):
        self.global_batch_size = global_batch_size
        self.transport = transport
        self._connected_engines: tuple[RolloutEngineGroup, int] | None = None
        self._frozen_sent: tuple[RolloutEngineGroup, int] | None = None  # the engine start that has the frozen tensors
        self._weight_names: set[str] | None = None  # what the first (full) sync sent
        self.frozen_names: frozenset[str] = frozenset()
        self._sync_counts: collections.Counter = collections.Counter()
        device = "cuda" if placement.use_gpu else "cpu"
        n = placement.num_trainers
        threads = cpu_threads_per_actor(n + (0 if placement.colocate else placement.num_engines))
        master_addr, master_port = ray.get(_rendezvous.options(**placement.trainer_options(0)).remote())
        self.actors = [
            TrainerActor.options(**placement.trainer_options(rank)).remote(
                backend_factory, RankInfo(rank, n, master_addr, master_port, device), threads
            )
            for rank in range(n)
        ]
        self.dp_ranks: list[int] = []
        self.dp_size = 0

    def init(self) -> int:
        """Build every rank; returns the first rollout id to run (after ``--load``)."""
        results = ray.get([a.init.remote() for a in self.actors])
        starts = {start for start, _, _, _ in results}
        if len(starts) != 1:
            raise RuntimeError(f"trainer ranks disagree on the resume point: {sorted(starts)}")
        self.dp_ranks = [dp_rank for _, dp_rank, _, _ in results]
        self.dp_size = results[0][2]
        self.frozen_names = frozenset(results[0][3])
        return starts.pop()

    def split_by_rank(self, samples: list[Sample]) -> tuple[list[list[Sample]], int]:
        """Cut ``samples`` into optimizer steps and each step evenly over data-parallel ranks.

        Returns ``(per trainer rank: its samples, steps in order; optimizer steps)``; ranks of one data-parallel
        rank (TP / PP / CP peers) get the same samples.  The divisibility of ``--global-batch-size`` by the
        data-parallel ranks is checked at parse time.

        Raises:
            ValueError: the sample count is not a positive multiple of the global batch size.
        """
        gbs, dp = self.global_batch_size, self.dp_size
        if not samples or len(samples) % gbs:
            raise ValueError(
                f"{len(samples)} samples cannot be split into optimizer steps of --global-batch-size {gbs}"
            )
        num_steps, per_rank = len(samples) // gbs, gbs // dp
        shards = [[] for _ in range(dp)]
        for step in range(num_steps):
            chunk = samples[step * gbs : (step + 1) * gbs]
            for r in range(dp):
                shards[r].extend(chunk[r * per_rank : (r + 1) * per_rank])
        return [shards[dp_rank] for dp_rank in self.dp_ranks], num_steps

    def train(self, rollout_id: int, samples: list[Sample]) -> dict[str, float]:
        """One rollout's optimizer steps on every rank; returns the reduced metrics (rank 0's; the memory figures of
        :data:`~slime.backends.step.LARGEST_OVER_RANKS` the largest of any rank's), with the trainer's
        sub-phase times and ``perf/train_transfer_s``: the seconds of this call spent outside
        :func:`~slime.backends.step.train_step` (shipping the samples to the ranks and the metrics back, Ray's
        scheduling)."""
        started = time.perf_counter()
        shards, num_steps = self.split_by_rank(samples)
        results = ray.get([a.train.remote(rollout_id, shard, num_steps) for a, shard in zip(self.actors, shards)])
        metrics = dict(results[0])
        for key in LARGEST_OVER_RANKS:  # the memory figures of the rank nearest its card's limit
            values = [r[key] for r in results if key in r]
            if values:
                metrics[key] = max(values)
        inside = metrics.get(TRAINER_TOTAL_KEY)
        if inside is not None:
            metrics[sub_phase_key("train", "transfer")] = max(0.0, time.perf_counter() - started - inside)
        return metrics

    def compute_log_probs(self, samples: list[Sample], rounding_noise: bool = False,
                          replay_routes: bool = False) -> list[list[float]]:
        """Current-policy log-probs of every sample's response (all ranks run the same samples):
        the engine parity check's trainer side (:func:`slime.backends.step.compute_log_probs`)."""
        return ray.get([a.compute_log_probs.remote(samples, rounding_noise, replay_routes) for a in self.actors])[0]

    def connect_ranks(self, transport: WeightTransport, engines: RolloutEngineGroup) -> list[ray.ObjectRef]:
        """Hand ``transport`` and the engine handles to every rank (:meth:`WeightTransport.connect_rank`
        there); returns the pending calls, so a transport can start the engines' side of a rendezvous too."""
        return [a.connect_weights.remote(transport, engines.actors) for a in self.actors]

    def update_weights(self, engines: RolloutEngineGroup) -> dict[str, int]:
        """Push the current weights into every rollout engine through the run's transport.

        One :meth:`WeightTransport.sync`: the first call connects the transport (:meth:`WeightTransport.connect`, once
        per run, and again after an engine was restarted); every call then runs ``begin_sync``, every rank's ``send``,
        and ``end_sync``, which tells the engine group that every engine has the current weights
        (:meth:`RolloutEngineGroup.weights_updated`: caches flushed, restarted engines serve again).  Frozen parameters
        (``--freeze-params-name-list``) are sent by the first sync after each engine start (the run's first, and the
        first after a restart) and left out of the others; :meth:`sync_metrics` counts what was sent.

        Returns:
            ``{checkpoint name: trainer rank that sent it}``.

        Raises:
            RuntimeError: no tensor was sent, a tensor came from two ranks, or this sync sent another
                set of names than the first one (names missing or extra are listed).
        """
        connect = self._connected_engines != (engines, engines.epoch)  # first sync, or an engine was restarted
        full = not self.frozen_names or self._frozen_sent != (engines, engines.epoch)
        sources = self.transport.sync(self, engines, lambda: ray.get([a.send_weights.remote(not full)
                                                                      for a in self.actors]), connect=connect)
        self._connected_engines = (engines, engines.epoch)
        if full:
            self._frozen_sent = (engines, engines.epoch)
        names = set(sources)
        first = self._weight_names  # the run's first sync is a full one
        expected = None if first is None else (first if full else first - self.frozen_names)
        if expected is not None and names != expected:
            missing, extra = sorted(expected - names), sorted(names - expected)
            raise RuntimeError(
                f"weight sync sent other tensors than the first sync: missing {missing[:5]} ({len(missing)}), "
                f"extra {extra[:5]} ({len(extra)})"
            )
        if first is None:
            self._weight_names = names
        frozen_sent = len(names & self.frozen_names)
        self._sync_counts.update({"weight_sync/syncs": 1, "weight_sync/full_syncs": int(full),
                                  "weight_sync/tensors_sent": len(names), "weight_sync/frozen_tensors_sent": frozen_sent})
        return sources

    def sync_metrics(self) -> dict[str, float]:
        """``weight_sync/{syncs, full_syncs, tensors_sent, frozen_tensors_sent}`` since the last call (then reset):
        syncs run, those that sent the frozen tensors too, checkpoint tensors sent, frozen ones among them."""
        counts, self._sync_counts = self._sync_counts, collections.Counter()
        return {key: float(counts[key]) for key in ("weight_sync/syncs", "weight_sync/full_syncs",
                                                     "weight_sync/tensors_sent", "weight_sync/frozen_tensors_sent")}

    def save(self, rollout_id: int, path: str | os.PathLike) -> None:
        ray.get([a.save.remote(rollout_id, str(path)) for a in self.actors])

    def offload(self, keep_weights: bool = False) -> None:
        """Every rank moves its training memory off the GPU; with ``keep_weights`` the policy
        weights stay for the weight sync (see :meth:`slime.backends.handover.HandOver.offload`)."""
        ray.get([a.offload.remote(keep_weights) for a in self.actors])

    def onload(self, weights_only: bool = False) -> None:
        """Every rank moves everything :meth:`offload` moved back to the GPU; with ``weights_only`` the policy
        weights alone, for a weight push (see :meth:`slime.backends.handover.HandOver.onload`)."""
        ray.get([a.onload.remote(weights_only) for a in self.actors])

    def shutdown(self) -> None:
        """Kill every rank's actor (its process and the process group it held).

        Idempotent, and never raises: problems are logged, so that it can run in the driver's
        ``finally`` without hiding the error that ended the run.
        """
        actors, self.actors = self.actors, []
        for rank, a in enumerate(actors):
            try:
                ray.kill(a)
            except Exception as e:  # noqa: BLE001 - clean-up goes on
                logger.warning("could not kill trainer rank %d: %s", rank, e)


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    """Address and free port on the node of trainer rank 0, for torch.distributed."""
    return node_ip(), free_port()
