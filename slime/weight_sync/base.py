"""The weight-sync interface: one transport object per run moves the trainers' weights into the engines.

What moves: tensors by **Hugging Face checkpoint name** (``model.language_model.layers.0...``,
``model.visual.blocks.0...``, ``lm_head.weight``; the vision tower keeps its HF names), in buckets of
about ``--update-weight-buffer-size`` bytes (:mod:`slime.weight_sync.buckets`).

Who sends what (:meth:`slime.backends.base.TrainerBackend.iter_weight_buckets`): each trainer rank yields
the tensors it is the source of; the union over ranks is the whole model, each name exactly once
(:func:`check_weight_sources` checks it after every sync).  The iterator is collective and in lockstep:
every rank yields the same number of buckets (``[]`` in a round it is not the source of), so a transport
may run its own collectives between buckets.

How it moves: a :class:`WeightTransport`, chosen once per run (:func:`slime.weight_sync.choose_transport`).
``trainers.update_weights(engines)`` (:class:`slime.ray.trainer_group.TrainerGroup`) runs::

    first call only:  transport.connect(trainers, engines)        # driver; calls connect_rank on every rank
    every call:       transport.begin_sync(engines)               # driver -> engines
                      on every rank: transport.send(buckets, rank, engine handles)
                      check_weight_sources(names sent by each rank)
                      transport.end_sync(engines)                 # driver -> engines

Built: :class:`~slime.weight_sync.object_store.ObjectStoreTransport` (every engine),
:class:`~slime.weight_sync.cuda_ipc.CudaIpcTransport` and :class:`~slime.weight_sync.nccl.NcclTransport`
(the SGLang engine); how each one moves the buckets: ``docs/design/weight_sync.md``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar, Iterable, Protocol, Sequence

import torch

from slime.weight_sync.config import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from slime.backends.base import RankInfo
    from slime.ray.engine_group import RolloutEngineGroup

WeightBucket = list[tuple[str, torch.Tensor]]
"""``(Hugging Face checkpoint name, tensor)`` pairs; a rank's share of one round (may be empty)."""


class TrainerRanks(Protocol):
    """What a transport uses of the trainer group (:class:`slime.ray.trainer_group.TrainerGroup`, which imports
    this package, so the group is described here rather than imported)."""

    actors: list[ActorHandle]
    """The trainer ranks' Ray actors, in rank order."""

    def connect_ranks(self, transport: WeightTransport, engines: RolloutEngineGroup) -> list[ObjectRef]:
        """Run ``transport.connect_rank`` on every rank; the refs to wait for."""


class WeightTransport(abc.ABC):
    """How weights travel from the trainer ranks to the engines; one instance per run.

    The driver holds it and calls the driver-side hooks; each trainer rank receives a copy
    (pickled through Ray by :meth:`connect`) and runs :meth:`connect_rank` once and :meth:`send`
    at every sync.  State made by :meth:`connect_rank` (a process group) lives in the rank's copy.

    Args:
        bucket_bytes: target size of one bucket, bytes (``--update-weight-buffer-size``), > 0;
            ``None`` (the flag not given): :data:`~slime.weight_sync.config.DEFAULT_BUCKET_BYTES`.
            A transport may lower it in :meth:`connect` to what it can carry (the object store does).

    Attributes:
        bucket_bytes: the size the ranks use.
        bucket_bytes_given: whether the user chose it (a transport that lowers it warns only then).

    Raises:
        ValueError: ``bucket_bytes <= 0``.
    """

    name: ClassVar[str]
    """The transport's name in :data:`slime.weight_sync.WEIGHT_TRANSPORTS`."""
    tensor_device: ClassVar[str | None] = None
    """Where the backend should put the yielded tensors: ``"cpu"``, or ``None`` for the rank's own device."""

    def __init__(self, bucket_bytes: int | None = None, num_experts: int | None = None):
        """``bucket_bytes``: ``--update-weight-buffer-size`` (None: the default); ``num_experts``: routed experts per
        MoE layer of the model (:func:`slime.weight_sync.fused_experts.checkpoint_num_experts`), for a transport
        that sends a layer's experts as fused tensors (CUDA IPC); None: a dense model, or unknown.

        Raises:
            ValueError: ``bucket_bytes <= 0``.
        """
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"--update-weight-buffer-size must be > 0 bytes, got {bucket_bytes}")
        self.bucket_bytes_given = bucket_bytes is not None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.num_experts = num_experts

    # ------------------------------------------------------------------ once per run

    def connect(self, trainers: TrainerRanks, engines: RolloutEngineGroup) -> None:
        """Driver side, once per run, before the first sync: set up the transport between the two groups.

        The default hands this transport to every trainer rank (:meth:`connect_rank` there) and waits.
        """
        import ray

        ray.get(trainers.connect_ranks(self, engines))

    def connect_rank(self, rank: RankInfo, engines: Sequence[ActorHandle]) -> None:
        """Trainer side, in each rank's process, once per run (collective over the trainer ranks).

        Args:
            rank: this rank's place in the trainer world.
            engines: the engines' Ray actor handles (:class:`slime.ray.engine_actor.EngineActor`), in order.
        """

    # ------------------------------------------------------------------ every sync

    def begin_sync(self, engines: RolloutEngineGroup) -> None:
        """Driver side, before the ranks send: prepare the engines (default: nothing)."""

    @abc.abstractmethod
    def send(self, buckets: Iterable[WeightBucket], rank: RankInfo, engines: Sequence[ActorHandle]) -> list[str]:
        """Trainer side, on every rank at once: move this rank's buckets into every engine.

        Args:
            buckets: from :meth:`~slime.backends.base.TrainerBackend.iter_weight_buckets` (lockstep,
                this rank's tensors only, on :attr:`tensor_device`).  Must be exhausted.
            rank: this rank's place in the trainer world.
            engines: the engines' actor handles, as given to :meth:`connect_rank`.

        Returns:
            The names this rank sent, in order.
        """

    def end_sync(self, engines: RolloutEngineGroup) -> None:
        """Driver side, after every rank has sent: default ``flush_cache`` on every engine, so no
        cached prefix computed with the old weights is reused."""
        engines.flush_cache()


def check_weight_sources(names_by_rank: Sequence[Sequence[str]]) -> dict[str, int]:
    """Check the backend contract after a sync: every name was sent by exactly one trainer rank.

    Args:
        names_by_rank: for each trainer rank, the names it sent (:meth:`WeightTransport.send`).

    Returns:
        ``{name: source rank}`` in sending order (rank 0's names first).

    Raises:
        RuntimeError: no rank sent anything, or a name came from two ranks (both named).
    """
    sources: dict[str, int] = {}
    for rank, names in enumerate(names_by_rank):
        for name in names:
            if name in sources:
                raise RuntimeError(
                    f"weight sync: {name!r} was sent by trainer ranks {sources[name]} and {rank}; each tensor "
                    "must have exactly one source rank (TrainerBackend.iter_weight_buckets)"
                )
            sources[name] = rank
    if not sources:
        raise RuntimeError("weight sync sent no tensors: no trainer rank yielded a weight (iter_weight_buckets)")
    return sources
