"""The native Megatron Qwen3.5 model against transformers on one GPU (marked gpu; skipped without CUDA).

Reference: ``Qwen3_5MoeForConditionalGeneration`` on its torch Gated DeltaNet path (fla hidden from
transformers), SDPA attention, one sequence at a time.  Ours: the same weights, the sequences packed
into one THD micro-batch.  Checks (issue 8's acceptance), each printing its figure (``pytest -s``):

- tiny model with Qwen3.5-35B-A3B's head geometry, text + geo3k image prompts, 4 sequences packed:
  fp32 with the torch GDN path and TF32 off (<= 1e-4), fp32 with fla's kernels (<= 5e-3, fla uses
  TF32 inside), bf16 with fla + varlen (<= 2e-2); parameter gradients; packed == one at a time;
- 4 layers (3 GDN + 1 attention) at Qwen3.5-35B-A3B's real widths, bf16 forward and backward: ours and
  HF bf16 each against HF fp32 on the same weights (both replaying the fp32 run's routing); ours within
  ``max(2e-2, 1.5 x HF bf16's own error)`` (logits; gradients per parameter), per-layer errors reported.

Errors are ``max |ours - ref| / max |ref|`` over the logits, and ``||g - g_ref|| / ||g_ref||`` per
parameter for gradients.  MoE top-k routing is discontinuous: below fp32-without-TF32 precision a few
tokens sit at near-ties and pick other experts in any two implementations (HF's own bf16 run against its
fp32 run as well), which moves their logits by far more than rounding.  The bounds therefore apply with
HF's expert choices replayed into our routers (megatron-core's ``RouterReplay``, the mechanism RL uses to
replay rollout routing); the free-routing figures are reported beside them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("megatron.core")

from slime.models.qwen3_5.build import initialize_single_process, native_from_hf_model, transformers_qwen35_without_fla  # noqa: E402

HF_MODELING = transformers_qwen35_without_fla()

from qwen35_helpers import geo3k_prompts  # noqa: E402

from slime.checkpoints.scaled_qwen35 import scaled_config  # noqa: E402
from slime.models.qwen3_5.config import Qwen35Kernels  # noqa: E402
from slime.models.qwen3_5.model import Qwen35Document, Qwen35Inputs  # noqa: E402
from slime.models.qwen3_5.hf_mapping import Ranks  # noqa: E402
from slime.models.qwen3_5.weights import StateDictReader, model_rules, read_rank_state  # noqa: E402
from tests.helpers import REALGEO_PIXELS  # noqa: E402

FIGURES = os.environ.get("SLIME_GPU_FIGURES")  # a .jsonl file the figures are appended to
MIN_PIXELS, MAX_PIXELS = REALGEO_PIXELS


def record(name: str, value) -> None:
    print(f"FIGURE {name} = {value}")
    if FIGURES:
        with open(FIGURES, "a") as f:
            f.write(json.dumps({"name": name, "value": value}) + "\n")


@pytest.fixture(scope="module", autouse=True)
def megatron_gpu():
    initialize_single_process("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


def _documents(processor, vocab: int, image_token_id: int | None = None, text_lengths=(97, 5), response=40,
               rows=(0, 3), seed=1) -> list[Qwen35Document]:
    """geo3k image prompts (+ random responses) and random text sequences, interleaved."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for p in geo3k_prompts(processor, list(rows)):
        ids = p["input_ids"]
        if image_token_id is not None:  # another tokenizer's ids for the same layout
            pad = ids == processor.image_token_id
            ids = torch.randint(0, vocab - 1000, ids.shape, generator=gen).masked_fill(pad, image_token_id)
        docs.append(Qwen35Document(torch.cat([ids, torch.randint(0, vocab - 1000, (response,), generator=gen)]),
                                   p["pixel_values"], p["image_grid_thw"]))
    texts = [Qwen35Document(torch.randint(0, vocab - 1000, (n,), generator=gen)) for n in text_lengths]
    return [d for pair in zip(docs, texts) for d in pair] + docs[len(texts):] + texts[len(docs):]


def _hf_logits(hf, doc: Qwen35Document, image_token_id: int) -> torch.Tensor:
    ids = doc.input_ids.view(1, -1).to(hf.device)
    kwargs = {}
    if doc.pixel_values is not None:
        kwargs = dict(pixel_values=doc.pixel_values.to(hf.device), image_grid_thw=doc.image_grid_thw.to(hf.device),
                      mm_token_type_ids=(ids == image_token_id).long())
    return hf(input_ids=ids, **kwargs).logits[0]


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _hf_forward(hf, documents, image_token_id, record_routing: bool):
    """HF logits of the documents one at a time, and (optionally) each MoE layer's chosen experts
    ``[T, top_k]`` for the packed token order."""
    gates = [layer.mlp.gate for layer in hf.model.language_model.layers]
    chosen: list[list[torch.Tensor]] = [[] for _ in gates]
    hooks = [g.register_forward_hook(lambda m, a, out, i=i: chosen[i].append(out[2].detach()))
             for i, g in enumerate(gates)] if record_routing else []
    try:
        logits = torch.cat([_hf_logits(hf, d, image_token_id) for d in documents])
    finally:
        for h in hooks:
            h.remove()
    return logits, [torch.cat(c) for c in chosen] if record_routing else None


def _compare(native, hf, documents, *, grads: bool, replay: bool = False):
    """(logits error, {param: grad error}) of packed ours vs HF one at a time.

    ``replay``: our MoE layers take HF's expert choices (megatron-core's RouterReplay; the model must be
    built with ``moe_enable_routing_replay``), so that top-k flips at near-ties do not enter the figure.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    arch = native.qwen_config.arch
    inputs = Qwen35Inputs.pack(documents, arch).to("cuda")
    weights = torch.randn(inputs.input_ids.numel(), arch.vocab_size, device="cuda",
                          generator=torch.Generator("cuda").manual_seed(2))
    native.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        ref, routing = _hf_forward(hf, documents, arch.image_token_id, record_routing=replay)
        if replay:
            RouterReplay.set_replay_data(routing)
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            ours = native(inputs)[:, 0, : arch.vocab_size]
        finally:
            if replay:
                RouterReplay.clear_global_router_replay_action()
                RouterReplay.clear_global_indices()
        if grads:
            (ours.float() * weights).sum().backward()
            (ref.float() * weights).sum().backward()
    error = _rel(ours, ref)
    grad_errors = {}
    if grads:
        expected = _hf_grads(hf, native)
        for name, p in native.named_parameters():
            grad_errors[name] = _grad_error(p.grad, expected[name])
    native.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    return error, grad_errors


def _hf_grads(hf, native) -> dict[str, torch.Tensor]:
    """HF's parameter gradients in the native layout (the loader's rules, fused in-memory experts)."""
    return read_rank_state(StateDictReader({n: p.grad for n, p in hf.named_parameters()}),
                           model_rules(native, Ranks(), fused_experts=True))


def _grad_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    g, ref = g.float(), ref.float()
    return ((g - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _replaying_native(hf, kernels):
    """The native model of ``hf`` with megatron-core's routing replay enabled (its routers only)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    return native_from_hf_model(hf, kernels=kernels, moe_enable_routing_replay=True)


def _over_floor(errors: dict[str, float], floor: dict[str, float], bound: float, factor: float):
    """Per name, the allowed error ``max(bound, factor * floor[name])`` (``floor``: HF's own bf16 error
    against the fp32 reference, the noise of bf16 itself).

    Returns:
        ``({name: (error, floor)}`` of the names over it, the name closest to / furthest over its allowance).
    """
    allowed = {n: max(bound, factor * floor[n]) for n in errors}
    over = {n: (e, floor[n]) for n, e in errors.items() if e > allowed[n]}
    return over, max(errors, key=lambda n: errors[n] / allowed[n])


def _split(grad_errors):
    decay = {n: e for n, e in grad_errors.items() if n.endswith(("A_log", "dt_bias"))}
    rest = {n: e for n, e in grad_errors.items() if n not in decay}
    worst = lambda d: max(d.items(), key=lambda kv: kv[1])  # noqa: E731
    return worst(rest), worst(decay)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_fla_kernels_match_float64_recurrence(dtype, bound):
    """fla's packed chunk_gated_delta_rule and causal_conv1d (the GDN layer's kernels) at Qwen3.5's GDN
    head shapes (32 value heads, q/k repeated from 16, d_k = d_v = 128), two documents, output and
    every input gradient against the float64 recurrence / torch convolution."""
    import torch.nn.functional as F
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from qwen35_helpers import recurrent_gated_delta_rule_f64

    from slime.models.qwen3_5.gdn import causal_conv1d_packed
    from slime.models.qwen3_5.packing import PackedSequences

    gen = torch.Generator("cuda").manual_seed(0)
    packing = PackedSequences.from_lengths([700, 300], device="cuda")
    T, H, D = 1000, 32, 128
    q, k, v = (torch.randn(T, H, D, device="cuda", generator=gen) for _ in range(3))
    a_log = torch.empty(H, device="cuda").uniform_(0.01, 16, generator=gen).log()  # transformers' A init
    g = -a_log.exp() * F.softplus(torch.randn(T, H, device="cuda", generator=gen) + 1.0)
    beta = torch.rand(T, H, device="cuda", generator=gen)
    w_out = torch.randn(T, H, D, device="cuda", generator=gen, dtype=torch.float64)
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)] + [
        g.detach().clone().requires_grad_(), beta.detach().to(dtype).requires_grad_()]
    out, _ = chunk_gated_delta_rule(*(x.unsqueeze(0) for x in leaves), use_qk_l2norm_in_kernel=True,
                                    cu_seqlens=packing.cu_seqlens.long())
    (out[0].double() * w_out).sum().backward()
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, g, beta)]
    ref = recurrent_gated_delta_rule_f64(*ref_leaves, packing.cu_seqlens.cpu())
    (ref * w_out).sum().backward()
    errors = {"o": _rel(out[0], ref)}
    for name, x, r in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves, ref_leaves):
        errors[name] = _rel(x.grad, r.grad)
    # Short convolution with document resets, against the torch path in float64.
    x = torch.randn(T, 8192, device="cuda", generator=gen)
    w = torch.randn(8192, 4, device="cuda", generator=gen) * 0.5
    xs, ws = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    y, _ = causal_conv1d(xs.unsqueeze(0), weight=ws, activation="silu", cu_seqlens=packing.cu_seqlens.long())
    w_y = torch.randn(T, 8192, device="cuda", generator=gen, dtype=torch.float64)
    (y[0].double() * w_y).sum().backward()
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = causal_conv1d_packed(xr, wr, packing.positions())
    (yr * w_y).sum().backward()
    errors.update(conv_y=_rel(y[0], yr), conv_dx=_rel(xs.grad, xr.grad), conv_dw=_rel(ws.grad, wr.grad))
    record(f"fla_kernels.{str(dtype).split('.')[-1]}", errors)
    assert max(errors.values()) <= bound, errors


@pytest.fixture(scope="module")
def tiny_pair(realgeo):
    """(HF fp32 model, documents, HF fp32 logits of the documents one at a time)."""
    from slime.data.processor import load_processor

    hf = HF_MODELING.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        realgeo, dtype=torch.float32, attn_implementation="sdpa").cuda()
    processor = load_processor(realgeo)
    documents = _documents(processor, hf.config.text_config.vocab_size)
    with torch.no_grad():
        ref32 = torch.cat([_hf_logits(hf, d, hf.config.image_token_id) for d in documents])
    return hf, documents, ref32


@pytest.mark.parametrize(
    "name, dtype, kernels, bound, grad_bound",
    [
        ("fp32_torch", torch.float32, Qwen35Kernels(gdn="torch", attention="sdpa"), 1e-4, 1e-4),
        pytest.param("fp32_fla", torch.float32, Qwen35Kernels(gdn="fla", attention="sdpa"), 5e-3, 5e-3, marks=pytest.mark.xfail(
            reason="fla 0.6.0's fp32 backward on Hopper + Triton 3.6 gives a wrong gradient of the decay g (A_log/dt_bias "
                   "gradients ~84% off, H200 2026-12-01) while logits (2.7e-4) and every other gradient (<= 2.5e-3) agree; "
                   "bf16 is correct (test_fla_kernels_match_float64_recurrence)", strict=False)),
        ("bf16_fla_varlen", torch.bfloat16, Qwen35Kernels(gdn="fla", attention="varlen"), 2e-2, 2e-2),
    ],
)
def test_tiny_realgeo_matches_hf(tiny_pair, name, dtype, kernels, bound, grad_bound):
    hf32, documents, ref32 = tiny_pair
    floor_grads = None
    if dtype != torch.float32:  # HF's fp32 gradients, to measure HF's own bf16 gradient error (the noise floor)
        arch = hf32.config.text_config
        weights = torch.randn(sum(d.input_ids.numel() for d in documents), arch.vocab_size, device="cuda",
                              generator=torch.Generator("cuda").manual_seed(2))
        hf32.zero_grad(set_to_none=True)
        (_hf_forward(hf32, documents, hf32.config.image_token_id, False)[0].float() * weights).sum().backward()
        floor_grads = {n: p.grad.detach().clone() for n, p in hf32.named_parameters()}
        hf32.zero_grad(set_to_none=True)
    hf = hf32 if dtype == torch.float32 else hf32.to(dtype)
    try:
        native = _replaying_native(hf, kernels)
        if dtype != torch.float32:  # context for the bf16 bound: both models' own error vs the fp32 reference
            arch = native.qwen_config.arch
            with torch.no_grad():
                ours = native(Qwen35Inputs.pack(documents, arch).to("cuda"))[:, 0, : arch.vocab_size]
                theirs = torch.cat([_hf_logits(hf, d, arch.image_token_id) for d in documents])
            record(f"tiny_realgeo.{name}.ours_vs_hf_fp32_max_rel", _rel(ours, ref32))
            record(f"tiny_realgeo.{name}.hf_own_vs_hf_fp32_max_rel", _rel(theirs, ref32))
        free_error, _ = _compare(native, hf, documents, grads=False)
        record(f"tiny_realgeo.{name}.free_routing.logits_max_rel", free_error)
        error, grad_errors = _compare(native, hf, documents, grads=True, replay=True)
        (rest_name, rest), (decay_name, decay) = _split(grad_errors)
        record(f"tiny_realgeo.{name}.replayed_routing.logits_max_rel", error)
        record(f"tiny_realgeo.{name}.replayed_routing.grad_worst", [rest_name, rest])
        record(f"tiny_realgeo.{name}.replayed_routing.grad_worst_decay_param", [decay_name, decay])
        assert error <= bound
        if floor_grads is None:
            assert rest <= grad_bound
            assert decay <= max(grad_bound, 2e-3)
        else:
            # bf16: per parameter, within the bound or twice HF's own bf16-vs-fp32 gradient error (some
            # gradients, e.g. the vision LayerNorms before attention, lose ~40 % to bf16 in HF itself).
            hf.zero_grad(set_to_none=True)
            weights = torch.randn(sum(d.input_ids.numel() for d in documents), hf.config.text_config.vocab_size,
                                  device="cuda", generator=torch.Generator("cuda").manual_seed(2))
            (_hf_forward(hf, documents, hf.config.image_token_id, False)[0].float() * weights).sum().backward()
            hf_bf16 = _hf_grads(hf, native)
            hf.zero_grad(set_to_none=True)
            for n, p in hf.named_parameters():
                p.grad = floor_grads[n].to(p.dtype)
            hf_fp32 = _hf_grads(hf, native)
            hf.zero_grad(set_to_none=True)
            floor = {n: _grad_error(hf_bf16[n], hf_fp32[n]) for n in grad_errors}
            over, worst = _over_floor(grad_errors, floor, grad_bound, 2)
            record(f"tiny_realgeo.{name}.replayed_routing.grad_worst_vs_floor",
                   [worst, grad_errors[worst], floor[worst]])
            assert not over, sorted(over.items(), key=lambda kv: -kv[1][0])[:5]
    finally:
        hf32.to(torch.float32)


def test_tiny_realgeo_packed_equals_one_at_a_time(tiny_pair):
    hf, documents, _ = tiny_pair
    native = native_from_hf_model(hf.to(torch.bfloat16), kernels=Qwen35Kernels(gdn="fla", attention="varlen"))
    hf.to(torch.float32)
    arch = native.qwen_config.arch
    with torch.no_grad():
        packed = native(Qwen35Inputs.pack(documents, arch).to("cuda"))[:, 0]
        alone = torch.cat([native(Qwen35Inputs.pack([d], arch).to("cuda"))[:, 0] for d in documents])
    error = _rel(packed, alone)
    record("tiny_realgeo.bf16_fla_varlen.packed_vs_alone_max_rel", error)
    assert error <= 1e-2  # same kernels and weights; bf16 rounding differs only through the packing


class _HFRouting:
    """Records, or replays, the experts each HF MoE layer's router (``mlp.gate``) picks, call by call.

    HF runs one document per call; ``chosen[layer]`` holds each call's ``[S, top_k]`` indices in call
    order.  With ``replay`` (another run's ``chosen``), every router's output is replaced by those
    experts with HF's own weights for them (softmax over all experts in fp32, gathered, renormalised:
    ``Qwen3_5MoeTopKRouter.forward``), so gradients still reach the router; ``flips`` counts the
    (token, layer) pairs whose own top-k set differs from the replayed one.
    """

    def __init__(self, hf, replay: list[list[torch.Tensor]] | None = None):
        self.gates = [layer.mlp.gate for layer in hf.model.language_model.layers]
        self.replay, self.flips, self.tokens = replay, 0, 0
        self.chosen: list[list[torch.Tensor]] = [[] for _ in self.gates]

    def _hook(self, i, module, args, out):
        logits, _, own = out
        if self.replay is None:
            self.chosen[i].append(own.detach())
            return None
        idx = self.replay[i][len(self.chosen[i])].to(own.device)
        if idx.shape != own.shape:
            raise ValueError(f"layer {i}: replayed routing {tuple(idx.shape)} for a call routing {tuple(own.shape)}")
        self.chosen[i].append(idx)
        self.flips += int((own.sort(-1).values != idx.sort(-1).values).any(-1).sum())
        self.tokens += own.shape[0]
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, idx)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), idx

    def __enter__(self):
        self.handles = [g.register_forward_hook(lambda m, a, out, i=i: self._hook(i, m, a, out))
                        for i, g in enumerate(self.gates)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.gates = self.handles = []  # holds no reference to the model (the fp32 copy is freed)

    def packed(self) -> list[torch.Tensor]:
        """Per layer, ``[T, top_k]`` in the packed token order (for megatron-core's RouterReplay)."""
        return [torch.cat(c) for c in self.chosen]


def _layer_outputs(layers, hidden: list[list[torch.Tensor]], take):
    """Forward hooks appending ``take(output)`` (``[S, hidden]``, fp32, detached) of each layer, per call."""
    return [layer.register_forward_hook(lambda m, a, out, i=i: hidden[i].append(take(out).detach().float()))
            for i, layer in enumerate(layers)]


def _run_hf(hf, documents, loss_weights, rules, replay=None):
    """HF one document at a time, then backward of ``sum(logits * loss_weights)``.

    Returns:
        (logits ``[T, V]`` fp32, per decoder layer its output ``[T, hidden]`` fp32, gradients in the
        native layout ``{native name: tensor}``, the ``_HFRouting`` of the run).
    """
    layers = hf.model.language_model.layers
    hidden: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = _layer_outputs(layers, hidden, lambda out: (out[0] if isinstance(out, tuple) else out)[0])
    hf.zero_grad(set_to_none=True)
    try:
        with _HFRouting(hf, replay) as routing:
            logits = torch.cat([_hf_logits(hf, d, hf.config.image_token_id) for d in documents])
    finally:
        for h in hooks:
            h.remove()
    (logits.float() * loss_weights).sum().backward()
    grads = read_rank_state(StateDictReader({n: p.grad for n, p in hf.named_parameters()}), rules)
    hf.zero_grad(set_to_none=True)  # ``grads`` keeps the tensors
    return logits.detach().float(), [torch.cat(h) for h in hidden], grads, routing


def _run_native(native, documents, loss_weights, routing: list[torch.Tensor]):
    """Ours packed, the experts of ``routing`` (per layer ``[T, top_k]``) replayed; same returns as
    :func:`_run_hf` but the gradients are left in ``.grad``."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    arch = native.qwen_config.arch
    device = next(native.parameters()).device
    inputs = Qwen35Inputs.pack(documents, arch).to(device)
    layers = native.decoder.layers
    hidden: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = _layer_outputs(layers, hidden, lambda out: (out[0] if isinstance(out, tuple) else out)[:, 0])
    native.zero_grad(set_to_none=True)
    RouterReplay.set_replay_data([r.to(device) for r in routing])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        logits = native(inputs)[:, 0, : arch.vocab_size]
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        for h in hooks:
            h.remove()
    (logits.float() * loss_weights).sum().backward()
    return logits.detach().float(), [h[0] for h in hidden]


def _against_reference(hf, native, documents, ref_dtype: torch.dtype = torch.float32) -> dict:
    """HF (low precision) and ours (built from it) each against the same HF model cast to ``ref_dtype``.

    The reference (HF's torch GDN path and SDPA, whatever kernels ``hf`` was built with; TF32 is the
    caller's setting) routes itself; HF low-precision and ours replay its expert choices, so the three
    runs differ by rounding only.  All three take the same loss ``sum(logits * w)``, ``w ~ N(0, 1)``.

    Returns a dict of figures: ``logits`` (``{"hf": .., "ours": ..}`` max-rel vs the reference),
    ``layers`` (per decoder layer output, the same), ``grads`` (``{native name: (hf, ours)}``
    ``||g - g_ref|| / ||g_ref||``), ``ours_vs_hf`` (logits max-rel and per-parameter gradient errors of
    ours against HF low precision), ``hf_routing_flips`` (fraction of (token, layer) pairs where HF
    low precision would have picked other experts).
    """
    import copy

    rules = model_rules(native, Ranks(), fused_experts=True)
    device = next(hf.parameters()).device
    total = sum(d.input_ids.numel() for d in documents)
    loss_weights = torch.randn(total, hf.config.text_config.vocab_size, device=device,
                               generator=torch.Generator(device).manual_seed(2))
    reference = copy.deepcopy(hf).to(ref_dtype)  # exactly the low-precision weights, upcast
    try:
        ref_logits, ref_layers, ref_grads, ref_routing = _run_hf(reference, documents, loss_weights, rules)
    finally:
        del reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
    hf_logits, hf_layers, hf_grads, hf_routing = _run_hf(hf, documents, loss_weights, rules, replay=ref_routing.chosen)
    ours_logits, ours_layers = _run_native(native, documents, loss_weights, ref_routing.packed())
    ours_grads = {n: p.grad for n, p in native.named_parameters()}
    figures = {
        "logits": {"hf": _rel(hf_logits, ref_logits), "ours": _rel(ours_logits, ref_logits)},
        "layers": {"hf": [_rel(a, r) for a, r in zip(hf_layers, ref_layers)],
                   "ours": [_rel(a, r) for a, r in zip(ours_layers, ref_layers)]},
        "grads": {n: (_grad_error(hf_grads[n], ref_grads[n]), _grad_error(ours_grads[n], ref_grads[n])) for n in rules},
        "ours_vs_hf": {"logits": _rel(ours_logits, hf_logits),
                       "grads": {n: _grad_error(ours_grads[n], hf_grads[n]) for n in rules}},
        "hf_routing_flips": hf_routing.flips / max(hf_routing.tokens, 1),
        "hf_names": {n: ",".join(rule.hf_names) for n, rule in rules.items()},
    }
    native.zero_grad(set_to_none=True)
    return figures


def _check_against_reference(f: dict, prefix: str) -> None:
    """Records the figures of :func:`_against_reference` and asserts ours (low precision) within
    ``max(2e-2, 1.5 x HF low precision's own error)`` against the reference: the logits, and each
    parameter's gradient (the tiny test's floor pattern)."""
    names = f["hf_names"]
    hf_grads = {n: e[0] for n, e in f["grads"].items()}
    ours_grads = {n: e[1] for n, e in f["grads"].items()}
    def worst(d):
        return [names[max(d, key=d.get)], max(d.values())]

    record(f"{prefix}.bf16.ours_vs_hf_bf16.logits_max_rel", f["ours_vs_hf"]["logits"])  # context, not asserted
    record(f"{prefix}.bf16.ours_vs_hf_bf16.grad_worst", worst(f["ours_vs_hf"]["grads"]))
    record(f"{prefix}.bf16.hf_routing_flips_vs_fp32", f["hf_routing_flips"])
    for side in ("hf", "ours"):
        record(f"{prefix}.bf16_vs_fp32.{side}.logits_max_rel", f["logits"][side])
        record(f"{prefix}.bf16_vs_fp32.{side}.layer_output_max_rel", f["layers"][side])
    record(f"{prefix}.bf16_vs_fp32.hf.grad_worst", worst(hf_grads))
    record(f"{prefix}.bf16_vs_fp32.ours.grad_worst", worst(ours_grads))
    record(f"{prefix}.bf16_vs_fp32.grad_rel_hf_ours", {names[n]: list(e) for n, e in f["grads"].items()})
    over, tightest = _over_floor(ours_grads, hf_grads, 2e-2, 1.5)
    record(f"{prefix}.bf16_vs_fp32.grad_tightest_vs_floor",
           [names[tightest], ours_grads[tightest], hf_grads[tightest]])
    logits_over, _ = _over_floor({"logits": f["logits"]["ours"]}, {"logits": f["logits"]["hf"]}, 2e-2, 1.5)
    assert not logits_over, logits_over
    assert not over, sorted(((names[n], e) for n, e in over.items()), key=lambda kv: -kv[1][0])[:5]


def test_35b_layer_shapes_bf16_forward_backward_match_hf(realgeo):
    """bf16 at Qwen3.5-35B-A3B's widths: ours (fla + varlen) and HF bf16 each against HF in fp32 (same
    weights, TF32 off, torch GDN, SDPA), both replaying the fp32 run's routing.  Ours may be at most
    ``max(2e-2, 1.5 x HF bf16's own error)``, for the logits and per parameter for the gradients."""
    from slime.data.processor import load_processor

    config = scaled_config(layers=4, experts=256)
    with torch.device("cuda"):
        torch.manual_seed(0)
        hf = HF_MODELING.Qwen3_5MoeForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa")
    native = _replaying_native(hf, Qwen35Kernels(gdn="fla", attention="varlen"))
    documents = _documents(load_processor(realgeo), config.text_config.vocab_size,
                           image_token_id=config.image_token_id, text_lengths=(1000, 1500), response=200)
    record("scaled_35b.tokens", sum(d.input_ids.numel() for d in documents))
    free_error, _ = _compare(native, hf, documents, grads=False)
    record("scaled_35b.bf16.free_routing.logits_max_rel", free_error)
    _check_against_reference(_against_reference(hf, native, documents, torch.float32), "scaled_35b")
