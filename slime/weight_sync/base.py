"""The weight-sync interface: one transport object per run moves the trainers' weights into the engines.

Tensors move by Hugging Face checkpoint name, in buckets of about ``--update-weight-buffer-size`` bytes
(:mod:`slime.weight_sync.buckets`).  Each trainer rank yields the tensors it is the source of, in
lockstep rounds (``[]`` in a round it sources nothing), so a transport may run collectives between
buckets; the union over ranks is the whole model, each name once (:func:`check_weight_sources`).
``trainers.update_weights(engines)`` runs one :meth:`WeightTransport.sync`::

    first call only:  transport.connect(trainers, engines)        # driver; connect_rank on every rank
    every call:       transport.begin_sync(engines)               # driver -> engines
                      on every rank: transport.send(buckets, rank, engine handles)
                      check_weight_sources(names sent by each rank)
                      transport.end_sync(engines)                 # driver -> engines: engines.weights_updated()

How each transport moves the buckets: ``docs/design/weight_sync.md``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Protocol, Sequence

import torch

from slime.weight_sync.config import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from slime.backends.config import RankInfo
    from slime.ray.engine_group import RolloutEngineGroup

WeightBucket = list[tuple[str, torch.Tensor]]
"""``(Hugging Face checkpoint name, tensor)`` pairs; a rank's share of one round (may be empty)."""


class TrainerRanks(Protocol):
    """What a transport uses of :class:`slime.ray.trainer_group.TrainerGroup` (described here: the group imports this).
    """

    actors: list[ActorHandle]
    """The trainer ranks' Ray actors, in rank order."""

    def connect_ranks(self, transport: WeightTransport, engines: RolloutEngineGroup) -> list[ObjectRef]:
        """Run ``transport.connect_rank`` on every rank; the refs to wait for."""


class WeightTransport(abc.ABC):
    """How weights travel from the trainer ranks to the engines; one instance per run, held by the driver.

    Each trainer rank gets a pickled copy (by :meth:`connect`), runs :meth:`connect_rank` once and
    :meth:`send` at every sync; state made by :meth:`connect_rank` lives in the rank's copy.
    ``bucket_bytes`` (bytes; ``bucket_bytes_given``: whether the user chose it) may be lowered by
    :meth:`connect` to what the transport can carry.
    """

    name: ClassVar[str]
    """The transport's name in :data:`slime.weight_sync.WEIGHT_TRANSPORTS`."""
    tensor_device: ClassVar[str | None] = None
    """Where the backend should put the yielded tensors: ``"cpu"``, or ``None`` for the rank's own device."""

    def __init__(self, bucket_bytes: int | None = None, num_experts: int | None = None):
        """``bucket_bytes``: ``--update-weight-buffer-size`` (None: default); ``num_experts``: experts per MoE layer.

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
        """Driver side, once per run before the first sync (default: :meth:`connect_rank` on every rank, waited for)."""
        import ray

        ray.get(trainers.connect_ranks(self, engines))

    def connect_rank(self, rank: RankInfo, engines: Sequence[ActorHandle]) -> None:
        """Trainer side, once per run on every rank (collective); ``engines``: the engines' actor handles, in order."""

    # ------------------------------------------------------------------ every sync

    def sync(self, trainers: TrainerRanks, engines: RolloutEngineGroup, send: Callable[[], Sequence[Sequence[str]]], *,
             connect: bool) -> dict[str, int]:
        """Driver side, one whole sync: :meth:`connect` first when ``connect`` (the run's first sync, or the first
        after an engine restart), :meth:`begin_sync`, ``send()`` (every rank's :meth:`send`, waited for; the names
        each rank sent), :func:`check_weight_sources` of them, :meth:`end_sync`.

        Returns:
            ``{checkpoint name: trainer rank that sent it}``.

        Raises:
            RuntimeError: no tensor was sent, or one came from two ranks (:func:`check_weight_sources`).
        """
        if connect:
            self.connect(trainers, engines)
        self.begin_sync(engines)
        sources = check_weight_sources(send())
        self.end_sync(engines)
        return sources

    def begin_sync(self, engines: RolloutEngineGroup) -> None:
        """Driver side, before the ranks send (default: nothing)."""

    @abc.abstractmethod
    def send(self, buckets: Iterable[WeightBucket], rank: RankInfo, engines: Sequence[ActorHandle]) -> list[str]:
        """Trainer side, on every rank at once: move this rank's buckets (exhausting them) into the engines; names sent.
        """

    def end_sync(self, engines: RolloutEngineGroup) -> None:
        """Driver side, after every rank has sent: it must call :meth:`RolloutEngineGroup.weights_updated` (caches
        flushed, restarted engines serving); the default does only that."""
        engines.weights_updated()


def check_weight_sources(names_by_rank: Sequence[Sequence[str]]) -> dict[str, int]:
    """``{name: source rank}`` (rank 0's first) of the names each rank sent, checking each came from one rank.

    Raises:
        RuntimeError: no rank sent anything, or a name came from two ranks (both named).
    """
    sources: dict[str, int] = {}
    for rank, names in enumerate(names_by_rank):
        for name in names:
            if name in sources:
                raise RuntimeError(
                    f"weight sync: {name!r} was sent by trainer ranks {sources[name]} and {rank}; each tensor "
                    "must have exactly one source rank (the backend's iter_weight_buckets)"
                )
            sources[name] = rank
    if not sources:
        raise RuntimeError("weight sync sent no tensors: no trainer rank yielded a weight (iter_weight_buckets)")
    return sources
