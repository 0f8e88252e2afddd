"""Routed experts per token position: the compact form a sample carries, its checks, its token-axis layout.

An engine running an MoE model reports, for every position it ran a forward for, the ``top_k`` experts each
MoE layer chose there (SGLang 0.5.17 with ``--enable-return-routed-experts``: ``meta_info["routed_experts"]``).
For a prompt of ``P`` tokens and a response of ``R`` that is ``[P + R - 1, layers, top_k]``, positions
``0 .. P + R - 2`` (the last response token is never fed back).  Samples keep them as uint8
(:data:`ROUTE_DTYPE`: models of up to :data:`MAX_EXPERTS` experts).  The trainer replays them
(:mod:`slime.models.routes`); :func:`token_routes` lays a micro-batch's routes on its token axis, with
:data:`OWN_ROUTE` where the model keeps its own choice (a response's last token, padding).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from slime.checkpoints.hf import read_config, text_fields

ROUTE_DTYPE = np.uint8
"""How samples and engine outputs store expert ids."""
MAX_EXPERTS = 256
"""The most experts per layer :data:`ROUTE_DTYPE` can name."""
OWN_ROUTE = -1
"""In :func:`token_routes`: the model routes this position itself."""


class RouteError(ValueError):
    """Routed experts of the wrong shape or range, or a model whose routes do not fit :data:`ROUTE_DTYPE`."""


@dataclasses.dataclass(frozen=True)
class RouteShape:
    """What one position's routes look like in a model: ``[num_layers, top_k]`` ids in ``[0, num_experts)``.

    Raises:
        RouteError: ``num_experts`` above :data:`MAX_EXPERTS` (``what`` names the model, e.g. its config file).
    """

    num_layers: int
    top_k: int
    num_experts: int
    what: str = "the model"

    def __post_init__(self):
        if self.num_experts > MAX_EXPERTS:
            raise RouteError(f"{self.what} has {self.num_experts} experts per layer; routed experts are stored as "
                             f"uint8, which names at most {MAX_EXPERTS}")

    @classmethod
    def from_hf_config(cls, config: dict, what: str = "config.json") -> RouteShape | None:
        """The shape of a Hugging Face ``config.json`` dict (fields ``num_hidden_layers``, ``num_experts_per_tok``,
        ``num_experts`` under ``text_config`` or at the top level, SGLang's reading); None for a dense model.

        Raises:
            RouteError: more than :data:`MAX_EXPERTS` experts.
        """
        section = text_fields(config)
        experts = section.get("num_experts")
        if not isinstance(experts, int) or experts <= 0:
            return None
        return cls(int(section["num_hidden_layers"]), int(section["num_experts_per_tok"]), experts, what)

    @classmethod
    def from_checkpoint(cls, hf_checkpoint: str) -> RouteShape | None:
        """:meth:`from_hf_config` of ``<hf_checkpoint>/config.json`` (None without one; CheckpointError if
        unreadable)."""
        config = read_config(hf_checkpoint)
        return None if config is None else cls.from_hf_config(config, f"--hf-checkpoint {hf_checkpoint}")


def compact_routes(ids: np.ndarray, shape: RouteShape, where: str) -> np.ndarray:
    """``ids`` (any integer array ``[N, num_layers, top_k]``) as :data:`ROUTE_DTYPE`.

    Raises:
        RouteError: another layer count or top-k, or an id outside ``[0, num_experts)`` (``where`` names the
            request or sample).
    """
    ids = np.asarray(ids)
    if ids.ndim != 3 or ids.shape[1:] != (shape.num_layers, shape.top_k):
        raise RouteError(f"{where}: routed experts of shape {list(ids.shape)}, expected [positions, "
                         f"{shape.num_layers} layers, top-{shape.top_k}]")
    if ids.size and (ids.min() < 0 or ids.max() >= shape.num_experts):
        raise RouteError(f"{where}: routed expert ids span {int(ids.min())}..{int(ids.max())}, outside 0.."
                         f"{shape.num_experts - 1}")
    return ids.astype(ROUTE_DTYPE)


def check_routes(routes: np.ndarray, prompt_len: int, response_len: int, shape: RouteShape, where: str) -> None:
    """Refuse routes that are not ``[prompt_len + response_len - 1, layers, top_k]`` :data:`ROUTE_DTYPE` ids of
    ``shape``.

    Raises:
        RouteError: naming ``where``, the shape found and the one expected.
    """
    expected = (prompt_len + response_len - 1, shape.num_layers, shape.top_k)
    if not isinstance(routes, np.ndarray) or routes.dtype != ROUTE_DTYPE or routes.shape != expected:
        found = (f"{routes.dtype} {list(routes.shape)}" if isinstance(routes, np.ndarray)
                 else type(routes).__name__)
        raise RouteError(f"{where}: routed experts are {found}, expected uint8 {list(expected)} (prompt "
                         f"{prompt_len} + response {response_len} - 1 positions, {shape.num_layers} layers, "
                         f"top-{shape.top_k})")
    if routes.size and int(routes.max()) >= shape.num_experts:
        raise RouteError(f"{where}: routed expert id {int(routes.max())} >= the model's {shape.num_experts} experts")


def token_routes(routes: Sequence[np.ndarray], starts: Sequence[int], total: int, shape: RouteShape) -> np.ndarray:
    """One micro-batch's routes on its token axis: int16 ``[total, num_layers, top_k]``, sample ``i``'s
    ``[n_i, num_layers, top_k]`` at rows ``starts[i] .. starts[i] + n_i`` (padded rows ``b * T``, or packed
    offsets), :data:`OWN_ROUTE` everywhere else (each response's last token, padding)."""
    out = np.full((total, shape.num_layers, shape.top_k), OWN_ROUTE, dtype=np.int16)
    for sample_routes, start in zip(routes, starts, strict=True):
        out[start: start + len(sample_routes)] = sample_routes
    return out


def sample_routes(token_axis: np.ndarray, starts: Sequence[int], lengths: Sequence[int],
                  shape: RouteShape) -> list[np.ndarray]:
    """The inverse of :func:`token_routes`: from a micro-batch's ``[total, num_layers, top_k]`` ids on its token axis
    (a router's own choices), sample ``i``'s rows ``starts[i] .. starts[i] + lengths[i]`` as :data:`ROUTE_DTYPE`.

    Raises:
        RouteError: ids of another shape or outside ``[0, num_experts)``.
    """
    return [compact_routes(token_axis[start: start + n], shape, f"the trainer's routes of sample {i}")
            for i, (start, n) in enumerate(zip(starts, lengths, strict=True))]
