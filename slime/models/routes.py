"""Replaying given routed experts in an MoE model, and capturing the ones it chooses.

Replay (routing replay): every MoE layer takes the given top-k experts of each token and recomputes their gate
weights from the model's own router logits as Qwen3.5 does for its own choice (:func:`forced_gate_weights`), so
the router still gets gradients.  The routes come from :func:`slime.data.routes.token_routes`: one row per token
of the model's flattened token axis, :data:`~slime.data.routes.OWN_ROUTE` where the model keeps its own choice.
Here for the Hugging Face model (``Qwen3_5MoeTopKRouter``, one per ``Qwen3_5MoeSparseMoeBlock``):
:func:`force_hf_routes` and :func:`capture_hf_routes`; the native model's router is
:class:`slime.models.qwen3_5.router.Qwen35Router`, which uses the same :func:`forced_gate_weights`.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch
from torch import Tensor

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def forced_gate_weights(router_logits: Tensor, experts: Tensor) -> Tensor:
    """float32 ``[N, k]`` gate weights of ``experts`` (int64 ``[N, k]``) from ``router_logits`` (``[N, E]``): the
    softmax over all experts taken at ``experts``, renormalised to sum 1 (transformers' ``Qwen3_5MoeTopKRouter``;
    in exact arithmetic megatron-core's softmax over the top-k logits); differentiable in ``router_logits``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32).gather(-1, experts)
    return probs / probs.sum(dim=-1, keepdim=True)


def choose_routes(forced: Tensor | None, own: Tensor) -> Tensor:
    """``forced`` (int ``[N, k]``, rows of :data:`~slime.data.routes.OWN_ROUTE` where the model chooses) with
    those rows taken from ``own`` (int64 ``[N, k]``, the model's choice); ``own`` when ``forced`` is None.

    Raises:
        ValueError: ``forced`` has another number of rows or columns than ``own``.
    """
    if forced is None:
        return own
    if forced.shape != own.shape:
        raise ValueError(f"replayed routes of shape {list(forced.shape)} for a router that routes "
                         f"{list(own.shape)} (tokens, top-k)")
    forced = forced.to(device=own.device, dtype=torch.int64)
    return torch.where(forced[:, :1] >= 0, forced, own)


def hf_moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformers MoE routers of ``model`` (modules whose class name ends in ``TopKRouter``), in layer order.

    Raises:
        ValueError: a router outside a ``layers.<i>.`` module, or two in one layer.
    """
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("TopKRouter"):
            continue
        match = _LAYER.search(name)
        if match is None or int(match.group(1)) in found:
            raise ValueError(f"cannot tell the layer of the MoE router {name}")
        found[int(match.group(1))] = module
    return [found[i] for i in sorted(found)]


@contextlib.contextmanager
def force_hf_routes(model: torch.nn.Module, routes: Tensor) -> Iterator[None]:
    """Inside the block, layer ``l``'s router of ``model`` routes token ``n`` to ``routes[n, l]`` (its own choice
    where that row is :data:`~slime.data.routes.OWN_ROUTE`), with :func:`forced_gate_weights` in the router's dtype.

    Args:
        model: a transformers MoE model (every forward inside must have ``N`` tokens, batch and time flattened
            row-major, as the routers see them).
        routes: int ``[N, layers, top_k]`` (:func:`slime.data.routes.token_routes`).

    Raises:
        ValueError: ``routes`` names another number of layers than the model's routers, or (in a forward)
            another number of tokens or top-k.
    """
    routers = hf_moe_routers(model)
    if routes.shape[1] != len(routers):
        raise ValueError(f"routes for {routes.shape[1]} layers, the model has {len(routers)} MoE routers")

    def hook(layer: int):
        def replace(module, args, out):
            logits, weights, own = out
            index = choose_routes(routes[:, layer], own)
            return logits, forced_gate_weights(logits, index).to(weights.dtype), index
        return replace

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_hf_routes(model: torch.nn.Module) -> Iterator[list[list[Tensor]]]:
    """Record the experts every MoE router of ``model`` chooses inside the block.

    Yields:
        ``calls``: ``calls[l]`` is the list of layer ``l``'s choices, one int64 ``[N_f, top_k]`` CPU tensor per
        forward ``f`` (its tokens flattened row-major), filled as the forwards run.
    """
    routers = hf_moe_routers(model)
    calls: list[list[Tensor]] = [[] for _ in routers]

    def hook(layer: int):
        def record(module, args, out):
            calls[layer].append(out[2].detach().to("cpu", torch.int64))
        return record

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(routers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
