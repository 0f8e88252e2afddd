"""The MoE router of Qwen3.5: megatron-core's ``TopKRouter``, with its weight left where the model put it, and
routing replay.

Qwen3.5's router is a linear map ``[E, hidden]`` followed by a softmax over the top-k logits
(transformers ``Qwen3_5MoeTopKRouter``; megatron-core ``TopKRouter`` with
``moe_router_score_function='softmax'`` and ``moe_router_pre_softmax=False``, see
:mod:`slime.models.qwen3_5.config`).  megatron-core 0.16.1's ``TopKRouter.gating`` moves a CPU weight
to ``torch.cuda.current_device()`` on every call (a convenience for CPU-initialised GPU models),
which on a machine without CUDA raises.  :class:`Qwen35Router` computes the same gating with the
weight on its own device: the model is built on the device it runs on (CUDA in training, the CPU in
the CPU tests and tools), so the move is never needed.  Routing itself (top-k, softmax, the token
dispatcher) is megatron-core's, except while :attr:`Qwen35Router.forced_experts` is set
(:func:`replayed_routes`): then the router takes those experts and recomputes their gate weights with
:func:`slime.routing_replay.forced_gate_weights`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from slime.routing_replay import choose_routes, forced_gate_weights


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    return TopKRouter


class Qwen35Router(_router_class()):
    """megatron-core's ``TopKRouter`` whose gating GEMM runs on the weight's own device.

    ``gating(input [N, hidden]) -> logits [N, E]`` in the router dtype (``moe_router_dtype``:
    fp32 / fp64, default the input's), through megatron-core's ``router_gating_linear``.
    """

    forced_experts: torch.Tensor | None = None
    """int ``[N, top_k]`` experts for the next forward's ``N`` tokens (rows of ``-1``: the router's own choice),
    or None: megatron-core's routing."""
    captured: list[torch.Tensor] | None = None
    """While a list (:func:`captured_routes`): each forward appends the uint8 ``[N, top_k]`` CPU experts taken."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        from megatron.core.transformer.moe.moe_utils import router_gating_linear

        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return router_gating_linear(input, self.weight, self.bias, router_dtype)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron-core's routing, or with :attr:`forced_experts` set: those experts (the router's own top-k on
        their ``-1`` rows) with :func:`~slime.routing_replay.forced_gate_weights`.

        Returns:
            ``(probs [N, E], routing_map [N, E] bool)`` as megatron-core's.

        Raises:
            NotImplementedError: forced experts with a routing feature the replay does not apply (named).
            ValueError: forced experts for another number of tokens or top-k.
        """
        if self.forced_experts is None:
            probs, routing_map = super().routing(logits, padding_mask)
            if self.captured is not None:
                taken = routing_map.view(-1, routing_map.shape[-1]).to(torch.int8).topk(self.topk, dim=-1).indices
                self.captured.append(taken.to(torch.uint8).cpu())  # ids < 256 (RouteShape refuses wider models)
            return probs, routing_map
        self._check_replayable()
        logits = logits.view(-1, self.config.num_moe_experts)
        own = torch.topk(logits, k=self.topk, dim=-1).indices
        experts = choose_routes(self.forced_experts, own)
        weights = forced_gate_weights(logits, experts).type_as(logits)
        probs = torch.zeros_like(logits).scatter(1, experts, weights)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
        if self.captured is not None:
            self.captured.append(experts.detach().to(torch.uint8).cpu())
        return probs, routing_map

    def _check_replayable(self) -> None:
        """Raise NotImplementedError naming the first routing feature of the config that :meth:`routing` skips
        with forced experts (Qwen3.5's config sets none of them)."""
        c = self.config
        unsupported = {
            "moe_router_score_function": c.moe_router_score_function != "softmax",
            "moe_router_pre_softmax": c.moe_router_pre_softmax,
            "moe_router_topk_scaling_factor": bool(c.moe_router_topk_scaling_factor),
            "moe_router_group_topk": bool(c.moe_router_group_topk),
            "moe_router_enable_expert_bias": c.moe_router_enable_expert_bias,
            "moe_expert_capacity_factor": c.moe_expert_capacity_factor is not None,
            "moe_z_loss_coeff": bool(c.moe_z_loss_coeff),
            "moe_router_load_balancing_type": self.routing_type == "sinkhorn" or self.is_aux_loss_enabled(),
        }
        found = [name for name, on in unsupported.items() if on]
        if found:
            raise NotImplementedError(f"routing replay does not apply {found[0]} (set in this model's config)")


def moe_routers(model: torch.nn.Module) -> list[Qwen35Router]:
    """The :class:`Qwen35Router` s of ``model`` (this pipeline stage's layers), in module order."""
    return [m for m in model.modules() if isinstance(m, Qwen35Router)]


@contextlib.contextmanager
def replayed_routes(model: torch.nn.Module, routes: torch.Tensor | None, *, sp_rank: int = 0,
                    sp_size: int = 1) -> Iterator[None]:
    """Inside the block, every router of ``model`` takes its layer's experts from ``routes``.

    Args:
        model: one pipeline stage; each router reads the column of its global layer number
            (megatron-core's ``layer_number``, 1-based, offset by the stage's first layer).
        routes: int ``[T, layers, top_k]`` over the packed token axis (:func:`slime.routing_replay.token_routes`),
            or None (nothing forced).
        sp_rank, sp_size: under sequence parallelism the router sees this TP rank's ``T / sp_size`` tokens;
            it takes rows ``sp_rank * T / sp_size ..``.

    Raises:
        ValueError: ``T`` is not a multiple of ``sp_size``, or ``routes`` lacks a router's layer.
    """
    if routes is None:
        yield
        return
    total = routes.shape[0]
    if total % sp_size:
        raise ValueError(f"routes for {total} tokens cannot be split over {sp_size} sequence-parallel ranks")
    share = routes[sp_rank * (total // sp_size): (sp_rank + 1) * (total // sp_size)]
    routers = moe_routers(model)
    try:
        for router in routers:
            if not 1 <= router.layer_number <= share.shape[1]:
                raise ValueError(f"routes for {share.shape[1]} layers, a router of layer {router.layer_number}")
            router.forced_experts = share[:, router.layer_number - 1]
        yield
    finally:
        for router in routers:
            router.forced_experts = None


@contextlib.contextmanager
def captured_routes(model: torch.nn.Module) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Inside the block every router of ``model`` records the experts it takes (:attr:`Qwen35Router.captured`).

    Yields:
        Global 1-based layer number -> the list of that router's uint8 ``[N_f, top_k]`` CPU tensors, one per
        forward ``f``, filled as the forwards run (and kept after the block).
    """
    routers = moe_routers(model)
    found = {}
    for router in routers:
        router.captured = found[router.layer_number] = []
    try:
        yield found
    finally:
        for router in routers:
            router.captured = None
