"""Test-only helpers for the native Qwen3.5 model: a float64 recurrent GDN reference, megatron-core on
CPU, geo3k prompts, and the native model / HF model pair built from one checkpoint."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GEO3K = REPO / "examples" / "geo3k_vlm" / "data" / "train.parquet"


def recurrent_gated_delta_rule_f64(q, k, v, g, beta, cu_seqlens) -> torch.Tensor:
    """The gated delta rule token by token in float64, state reset at every document (Yang et al. 2025, eq. 10).

    ``q, k [T, H, dk]`` (raw: L2-normalised and scaled here), ``v [T, H, dv]``, ``g, beta [T, H]``,
    ``cu_seqlens [n + 1]`` -> ``[T, H, dv]`` float64.
    """
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    out = torch.zeros_like(v)
    bounds = [int(b) for b in cu_seqlens]
    for start, end in zip(bounds[:-1], bounds[1:]):
        state = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64, device=q.device)
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            predicted = torch.einsum("hk,hkv->hv", k[t], state)
            state = state + torch.einsum("hk,hv->hkv", k[t], (v[t] - predicted) * beta[t][:, None])
            out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return out


@contextlib.contextmanager
def megatron_on_cpu():
    """A one-process gloo group with megatron-core's parallel state (TP = PP = EP = 1), on the CPU.

    megatron-core's MoE router moves its weight to ``torch.cuda.current_device()`` on every call;
    here that device is the CPU for the duration of the block.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


def geo3k_prompts(processor, rows: list[int]) -> list[dict]:
    """Processed geo3k prompts (chat template, image) of ``rows`` of the bundled train set.

    Returns dicts with ``input_ids [L]`` int64, ``pixel_values``, ``image_grid_thw``.
    """
    import pandas as pd

    from slime.data.image import decode_image

    frame = pd.read_parquet(GEO3K)
    prompts = []
    for row in rows:
        record = frame.iloc[row]
        image = decode_image(record["images"][0], row=row, field="images")
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": record["problem"].replace("<image>", "")}]}]
        )
        out = processor(text, [image])
        prompts.append(dict(input_ids=torch.tensor(out.input_ids), pixel_values=out.pixel_values,
                            image_grid_thw=out.image_grid_thw))
    return prompts


def hf_forward_routes(model, input_ids, pixel_values=None, image_grid_thw=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts the transformers model's routers choose at every position of one plain forward over
    ``input_ids`` (1-D), and each choice's margin (router logit of the k-th chosen minus the best unchosen one).

    Returns:
        ``(routes int64 [T, layers, top_k], margin float32 [T, layers])``.
    """
    from slime.data.processor import mm_token_type_ids
    from slime.routing_replay import hf_moe_routers

    routers = hf_moe_routers(model)
    logits = []
    handles = [r.register_forward_hook(lambda m, a, out: logits.append(out[0].detach())) for r in routers]
    ids = torch.as_tensor(input_ids).view(1, -1)
    kwargs = {}
    if pixel_values is not None:
        kwargs = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                      mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id))
    try:
        with torch.no_grad():
            model(input_ids=ids, **kwargs)
    finally:
        for h in handles:
            h.remove()
    top_k = routers[0].top_k
    stacked = torch.stack(logits, 1)  # [T, L, E]
    ranked = stacked.sort(-1, descending=True)
    margin = ranked.values[..., top_k - 1] - ranked.values[..., top_k]
    return ranked.indices[..., :top_k], margin


def own_and_random_routes(model, samples, seed: int) -> tuple[list, list]:
    """Each sample's own routes (:func:`hf_forward_routes` over prompt + response, positions ``0 .. P + R - 2`` as
    an engine reports them) and random other routes of the same shape, both uint8 numpy ``[P + R - 1, layers,
    top_k]``.  Asserts every own choice is more than 1e-4 from a tie, so another implementation chooses the same."""
    import numpy as np

    num_experts = model.config.get_text_config().num_experts
    own, other, margins = [], [], []
    rng = np.random.default_rng(seed)
    for s in samples:
        mm = s.multimodal_inputs
        routes, margin = hf_forward_routes(model, s.prompt_token_ids + s.response_token_ids,
                                           mm.get("pixel_values"), mm.get("image_grid_thw"))
        own.append(routes[:-1].numpy().astype(np.uint8))
        margins.append(float(margin[:-1].min()))
        n, layers, top_k = own[-1].shape
        other.append(np.stack([rng.permutation(num_experts)[:top_k] for _ in range(n * layers)])
                     .reshape(n, layers, top_k).astype(np.uint8))
    assert min(margins) > 1e-4, margins
    return own, other


def moe_block_f64(block, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's MoE block by hand in float64: ``sum_j w_j E_j(x) + sigmoid(x g_s) S(x)``, ``w`` the softmax over
    all router logits taken at ``experts`` and renormalised, ``E_j(x) = W_down (silu(W_gate x) * W_up x)``."""
    x = x.double()
    logits = x @ block.gate.weight.double().T
    probs = torch.exp(logits - logits.max(-1, keepdim=True).values)
    probs = probs / probs.sum(-1, keepdim=True)
    chosen = probs.gather(-1, experts)
    weights = chosen / chosen.sum(-1, keepdim=True)
    gate_up, down = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    inter = down.shape[-1]
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(experts[n].tolist()):
            h = gate_up[e] @ x[n]
            out[n] += weights[n, j] * (down[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    shared = block.shared_expert
    s = (shared.down_proj.weight.double() @ (torch.nn.functional.silu(shared.gate_proj.weight.double() @ x.T)
                                             * (shared.up_proj.weight.double() @ x.T))).T
    return out + torch.sigmoid(x @ block.shared_expert_gate.weight.double().T) * s
