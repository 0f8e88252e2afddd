"""The native Megatron Qwen3.5 model (megatron-core on CPU, fp32, torch GDN + SDPA kernels) against
transformers' ``Qwen3_5MoeForConditionalGeneration`` on the same checkpoint.

The checkpoint is the tiny model with Qwen3.5-35B-A3B's attention geometry (head_dim 256, 25 %
interleaved MRoPE [11, 11, 10], GDN head dims 128) and geo3k images of a few hundred merged tokens,
so position and layout bugs move the logits visibly.  Reference: the HF model run one sequence at a
time; ours runs the sequences packed into one THD micro-batch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from qwen35_helpers import geo3k_prompts, megatron_on_cpu  # noqa: E402

from slime.models.qwen3_5.config import Qwen35Kernels, qwen35_config_from_hf  # noqa: E402
from slime.models.qwen3_5.model import Qwen35Document, Qwen35Inputs, Qwen35Model  # noqa: E402
from slime.models.qwen3_5.hf_mapping import Ranks  # noqa: E402
from slime.models.qwen3_5.weights import (  # noqa: E402
    StateDictReader,
    load_hf_checkpoint,
    model_rules,
    read_rank_state,
)
from tests.helpers import REALGEO_PIXELS  # noqa: E402

MIN_PIXELS, MAX_PIXELS = REALGEO_PIXELS  # 256..400 merged image tokens per image


@pytest.fixture(scope="module")
def models(realgeo):
    """(native, hf, load report); megatron-core's CPU state stays up for the module's tests."""
    from transformers import AutoModelForImageTextToText

    with megatron_on_cpu():
        config = qwen35_config_from_hf(
            realgeo, params_dtype=torch.float32, kernels=Qwen35Kernels(gdn="torch", attention="sdpa"),
            moe_token_dispatcher_type="allgather", use_cpu_initialization=True, perform_initialization=False,
        )
        native = Qwen35Model(config)
        report = load_hf_checkpoint(native, realgeo, Ranks())
        hf = AutoModelForImageTextToText.from_pretrained(realgeo, dtype=torch.float32, attn_implementation="sdpa")
        yield native, hf, report


@pytest.fixture(scope="module")
def documents(realgeo, models):
    """One geo3k image prompt with a 24-token response and two text sequences."""
    from slime.data.processor import load_processor

    processor = load_processor(realgeo)
    gen = torch.Generator().manual_seed(1)
    vocab = models[0].qwen_config.arch.vocab_size
    docs = []
    for p in geo3k_prompts(processor, [3]):
        response = torch.randint(0, vocab - 16, (24,), generator=gen)
        docs.append(Qwen35Document(torch.cat([p["input_ids"], response]), p["pixel_values"], p["image_grid_thw"]))
    docs.insert(0, Qwen35Document(torch.randint(0, vocab - 16, (97,), generator=gen)))
    docs.append(Qwen35Document(torch.randint(0, vocab - 16, (5,), generator=gen)))
    return docs


def _hf_logits(hf, doc: Qwen35Document, image_token_id: int) -> torch.Tensor:
    ids = doc.input_ids.view(1, -1)
    kwargs = {}
    if doc.pixel_values is not None:
        kwargs = dict(pixel_values=doc.pixel_values, image_grid_thw=doc.image_grid_thw,
                      mm_token_type_ids=(ids == image_token_id).long())
    return hf(input_ids=ids, **kwargs).logits[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_every_checkpoint_tensor_is_loaded(models):
    native, hf, report = models
    assert report.loaded == len(dict(native.named_parameters()))
    assert report.skipped == {}


def test_images_have_a_few_hundred_tokens_and_real_rotary(documents, models):
    arch = models[0].qwen_config.arch
    assert (arch.head_dim, arch.rotary_dim, arch.mrope_section) == (256, 64, (11, 11, 10))
    counts = [int(d.image_grid_thw.prod(-1).sum()) // 4 for d in documents if d.image_grid_thw is not None]
    assert len(counts) == 1 and all(256 <= c <= 400 for c in counts), counts


def test_packed_logits_match_hf_one_at_a_time(models, documents):
    native, hf, _ = models
    arch = native.qwen_config.arch
    with torch.no_grad():
        logits = native(Qwen35Inputs.pack(documents, arch))[:, 0, : arch.vocab_size]
        ref = torch.cat([_hf_logits(hf, d, arch.image_token_id) for d in documents])
    assert logits.shape == ref.shape
    assert _rel(logits, ref) <= 1e-4


def test_packed_equals_one_at_a_time(models, documents):
    native = models[0]
    arch = native.qwen_config.arch
    with torch.no_grad():
        packed = native(Qwen35Inputs.pack(documents, arch))[:, 0]
        alone = torch.cat([native(Qwen35Inputs.pack([d], arch))[:, 0] for d in documents])
    assert _rel(packed, alone) <= 1e-5


def test_parameter_gradients_match_hf(models, documents):
    native, hf, _ = models
    arch = native.qwen_config.arch
    gen = torch.Generator().manual_seed(2)
    inputs = Qwen35Inputs.pack(documents, arch)
    weights = torch.randn(inputs.input_ids.numel(), arch.vocab_size, generator=gen)
    native.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    (native(inputs)[:, 0, : arch.vocab_size] * weights).sum().backward()
    offset = 0
    for d in documents:
        n = d.input_ids.numel()
        (_hf_logits(hf, d, arch.image_token_id) * weights[offset: offset + n]).sum().backward()
        offset += n
    # HF's gradients in the native layout, through the same rules the loader uses (fused in-memory experts).
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    rules = model_rules(native, Ranks(), fused_experts=True)
    expected = read_rank_state(StateDictReader(hf_grads), rules)
    # Per parameter: ||g - g_hf|| / ||g_hf||.  The GDN decay parameters (A_log, dt_bias: one value per head,
    # their gradient a sum over every token through exp(cumulative decay)) differ more between two fp32
    # chunked implementations: ~1e-3 for heads that decay fast (A up to 16 in transformers' init);
    # test_qwen35_layers checks the kernel's decay gradient against a float64 recurrence.
    worst = {}
    for name, p in native.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        worst[name] = ((p.grad - expected[name]).norm() / expected[name].norm().clamp_min(1e-30)).item()
    decay = {n: e for n, e in worst.items() if n.endswith(("A_log", "dt_bias"))}
    rest = {n: e for n, e in worst.items() if n not in decay}
    assert max(rest.values()) <= 1e-4, sorted(rest.items(), key=lambda kv: -kv[1])[:5]
    assert max(decay.values()) <= 2e-3, sorted(decay.items(), key=lambda kv: -kv[1])[:5]


# ----------------------------------------------------------------------------- routing replay


def _random_routes(tokens: int, arch, seed: int) -> torch.Tensor:
    """int16 ``[tokens, layers, top_k]`` of distinct random experts per row; every 5th row -1 (the router's own)."""
    gen = torch.Generator().manual_seed(seed)
    top_k = arch.moe_router_topk
    rows = [torch.randperm(arch.num_experts, generator=gen)[:top_k] for _ in range(tokens * arch.num_layers)]
    routes = torch.stack(rows).view(tokens, arch.num_layers, arch.moe_router_topk).to(torch.int16)
    routes[::5] = -1
    return routes


def _own_native_routes(native, inputs: Qwen35Inputs) -> torch.Tensor:
    """The experts the native routers choose at every position (layer order), int16 ``[T, layers, top_k]``."""
    from slime.models.qwen3_5.router import moe_routers

    chosen = {}
    routers = moe_routers(native)
    handles = [r.register_forward_hook(lambda m, a, out: chosen.__setitem__(m.layer_number, out[1])) for r in routers]
    try:
        with torch.no_grad():
            native(inputs)
    finally:
        for h in handles:
            h.remove()
    top_k = routers[0].topk
    return torch.stack([chosen[n].int().topk(top_k, -1).indices for n in sorted(chosen)], 1).to(torch.int16)


def test_replaying_the_native_models_own_routes_changes_its_logits_by_rounding_only(models, documents):
    import dataclasses

    native = models[0]
    inputs = Qwen35Inputs.pack(documents, native.qwen_config.arch)
    own = _own_native_routes(native, inputs)
    with torch.no_grad():
        plain = native(inputs)
        replayed = native(dataclasses.replace(inputs, routed_experts=own))
    assert _rel(replayed, plain) <= 1e-6


def test_native_and_hf_agree_under_the_same_replayed_routes_and_so_do_router_gradients(models, documents):
    """Random routes (every 5th position the router's own): the packed native model and the HF model one document at
    a time give the same logits, other than without replay, and the same router-weight gradients, non-zero."""
    import dataclasses

    from slime.models.qwen3_5.router import moe_routers
    from slime.routing_replay import force_hf_routes, hf_moe_routers

    native, hf, _ = models
    arch = native.qwen_config.arch
    inputs = Qwen35Inputs.pack(documents, arch)
    routes = _random_routes(inputs.input_ids.numel(), arch, seed=4)
    forced = dataclasses.replace(inputs, routed_experts=routes)
    weights = torch.randn(inputs.input_ids.numel(), arch.vocab_size, generator=torch.Generator().manual_seed(5))
    native.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    logits = native(forced)[:, 0, : arch.vocab_size]
    (logits * weights).sum().backward()
    ref, offset = [], 0
    for d in documents:
        n = d.input_ids.numel()
        with force_hf_routes(hf, routes[offset: offset + n]):
            doc_logits = _hf_logits(hf, d, arch.image_token_id)
        (doc_logits * weights[offset: offset + n]).sum().backward()
        ref.append(doc_logits.detach())
        offset += n
    ref = torch.cat(ref)
    assert _rel(logits.detach(), ref) <= 1e-4
    with torch.no_grad():
        unforced = native(inputs)[:, 0, : arch.vocab_size]
    assert _rel(unforced, ref) > 1e-2  # the routes were others than the model's own
    for router, gate in zip(moe_routers(native), hf_moe_routers(hf), strict=True):
        assert router.weight.grad.abs().max() > 0
        error = (router.weight.grad - gate.weight.grad).norm() / gate.weight.grad.norm()
        assert error <= 1e-4, (router.layer_number, error.item())


def test_the_native_moe_layer_under_forced_routes_is_the_block_by_hand(models):
    from qwen35_helpers import moe_block_f64

    native, hf, _ = models
    arch = native.qwen_config.arch
    layer = native.decoder.layers[2].mlp
    x = torch.randn(9, 1, arch.hidden_size, generator=torch.Generator().manual_seed(6))
    routes = _random_routes(9, arch, seed=7)[:, 2].long()
    routes[::5] = torch.tensor([1, 3][: arch.moe_router_topk])  # no own-choice rows here
    layer.router.forced_experts = routes
    try:
        with torch.no_grad():
            out, _ = layer(x)
    finally:
        layer.router.forced_experts = None
    expected = moe_block_f64(hf.model.language_model.layers[2].mlp, x[:, 0], routes)
    torch.testing.assert_close(out[:, 0].double(), expected, rtol=1e-5, atol=1e-6)


def test_inputs_bound_for_a_gpu_go_through_pinned_memory_without_a_host_sync(monkeypatch):
    """A micro-batch's host tensors bound for CUDA are copied into page-locked memory and sent with
    ``non_blocking=True`` (a pageable copy first waits for the stream's queued kernels: one host synchronisation per
    micro-batch); to the CPU they move as before, and None stays None.  No GPU here: ``pin_memory`` and the copy to
    "cuda" are recorders, and the packed batch's every tensor is checked to take that path."""
    from slime.models.qwen3_5.model import Qwen35Inputs, to_device

    calls = []
    real_to = torch.Tensor.to

    def pin_memory(self):
        calls.append(("pin", tuple(self.shape)))
        return self.clone()

    def to(self, *args, **kwargs):
        device = torch.device(args[0]) if args and isinstance(args[0], (str, torch.device)) else None
        if device is not None and device.type == "cuda":
            calls.append(("to", tuple(self.shape), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    t = torch.arange(6)
    assert to_device(None, "cuda") is None
    assert to_device(t, "cpu") is t and calls == []
    to_device(t, torch.device("cuda", 0))
    assert calls == [("pin", (6,)), ("to", (6,), True)]

    calls.clear()
    inputs = Qwen35Inputs(input_ids=torch.zeros(5, dtype=torch.int64), position_ids=torch.zeros(3, 5, dtype=torch.int64),
                          cu_seqlens=torch.tensor([0, 5]), max_seqlen=5)
    inputs.to("cuda")
    moved = [c for c in calls if c[0] == "to"]
    assert {c[1] for c in moved} == {(5,), (3, 5), (2,)} and all(c[2] for c in moved)
    assert len([c for c in calls if c[0] == "pin"]) == len(moved)
