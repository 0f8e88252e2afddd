"""The fast fused-expert load of slime's SGLang plugin (slime/rollout/engines/sglang/expert_load.py).

Two references: a stand-in ``FusedMoE`` whose per-expert ``weight_loader`` is SGLang 0.5.17's rule written out by
hand (``FusedMoE._load_w13`` / ``_load_w2``: gate rows of this TP rank into the first half of ``w13``, up rows into
the second, down columns into ``w2``, global experts of this EP rank only), with the expected parameters built
expert by expert in float64; and, where SGLang is installed (the GPU image), SGLang's own
``FusedMoE.weight_loader``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch

from slime.rollout.engines.sglang import expert_load

LAYER = "model.language_model.layers.0.mlp.experts"
W13, W2 = "model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"  # SGLang's parameter names


class UnquantizedFusedMoEMethod:  # the name SGLang's unquantized method has
    pass


class StandInMoE(torch.nn.Module):
    """SGLang's ``FusedMoE`` as far as loading goes (module docstring), parameters filled with NaN."""

    def __init__(self, experts=8, hidden=6, inter=4, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1,
                 dtype=torch.float32, up_first=False):
        super().__init__()
        self.moe_tp_rank, self.moe_tp_size = tp_rank, tp_size
        self.local, self.ep_rank, self.up_first = experts // ep_size, ep_rank, up_first
        self.shard = inter // tp_size
        self.quant_method = UnquantizedFusedMoEMethod()
        self.moe_runner_config = types.SimpleNamespace(is_gated=True)
        self.w13_weight = torch.nn.Parameter(torch.full((self.local, 2 * self.shard, hidden), float("nan"),
                                                        dtype=dtype), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.full((self.local, hidden, self.shard), float("nan"), dtype=dtype),
                                            requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.calls = 0
        self._num_global_routed = experts
        self.layer_id = 0

    def _map_global_expert_id_to_local_expert_id(self, expert):
        local = expert - self.ep_rank * self.local
        return local if 0 <= local < self.local else -1

    def weight_loader(self, param, loaded, name, shard_id, expert):
        self.calls += 1
        local = self._map_global_expert_id_to_local_expert_id(expert)
        if local < 0:
            return
        rows = slice(self.moe_tp_rank * self.shard, (self.moe_tp_rank + 1) * self.shard)
        if shard_id == "w2":
            param.data[local].copy_(loaded[:, rows])
            return
        first = (shard_id == "w3") != self.up_first  # SGLang: w1 first unless load_up_proj_weight_first
        start = self.shard if first else 0
        param.data[local, start:start + self.shard].copy_(loaded[rows])


class SGLangLikeModel(torch.nn.Module):
    """A model whose ``load_weights`` does what SGLang's Qwen3.5 MoE one does with these names: fused experts
    expert by expert through ``weight_loader``, everything else by name."""

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        self.model.layers[0].mlp.experts = moe
        self.model.norm = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        self.received: list[str] = []

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            self.received.append(name)
            short = name.replace("model.language_model.", "model.")
            moe = self.model.layers[0].mlp.experts
            if short.endswith("experts.gate_up_proj"):
                gate, up = tensor.chunk(2, dim=-2)
                for e in range(tensor.shape[0]):
                    moe.w13_weight.weight_loader(moe.w13_weight, gate[e], W13, "w1", e)
                    moe.w13_weight.weight_loader(moe.w13_weight, up[e], W13, "w3", e)
            elif short.endswith("experts.down_proj"):
                for e in range(tensor.shape[0]):
                    moe.w2_weight.weight_loader(moe.w2_weight, tensor[e], W2, "w2", e)
            else:
                self.model.norm.data.copy_(tensor)
            loaded.add(short)
        return loaded


def _fused(experts=8, hidden=6, inter=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, dtype=torch.float64)
    down = torch.randn(experts, hidden, inter, generator=g, dtype=torch.float64)
    return gate_up, down


def _expected(gate_up, down, tp_rank, tp_size, ep_rank, ep_size):
    """w13 and w2 of one rank, expert by expert (float64)."""
    experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    shard, local = inter // tp_size, experts // ep_size
    rows = range(tp_rank * shard, (tp_rank + 1) * shard)
    w13, w2 = [], []
    for e in range(ep_rank * local, (ep_rank + 1) * local):
        gate = torch.stack([gate_up[e, r] for r in rows])
        up = torch.stack([gate_up[e, inter + r] for r in rows])
        w13.append(torch.cat([gate, up]))
        w2.append(torch.stack([down[e, :, r] for r in rows], dim=1))
    return torch.stack(w13), torch.stack(w2)


@pytest.fixture
def wrapped(monkeypatch):
    """A fresh model class with the wrapped load_weights, and fresh stats."""
    stats = expert_load.ExpertLoadStats()
    cls = type("Model", (SGLangLikeModel,), {})
    saves = []
    expert_load.wrap_load_weights(cls, stats, on_load=lambda: saves.append(stats.as_dict()))
    expert_load.wrap_load_weights(cls, stats)  # idempotent
    return types.SimpleNamespace(cls=cls, stats=stats, saves=saves)


@pytest.mark.parametrize("tp_rank, tp_size, ep_rank, ep_size", [(0, 1, 0, 1), (1, 2, 0, 1), (0, 1, 1, 2),
                                                                (1, 2, 1, 4)])
def test_fused_experts_land_where_sglangs_loader_puts_them(wrapped, tp_rank, tp_size, ep_rank, ep_size):
    gate_up, down = _fused()
    moe = StandInMoE(tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size, dtype=torch.float64)
    model = wrapped.cls(moe)
    norm = torch.arange(3.0)
    weights = iter([(f"{LAYER}.gate_up_proj", gate_up), ("model.language_model.norm.weight", norm),
                    (f"{LAYER}.down_proj", down)])  # a generator, as from disk
    loaded = model.load_weights(weights)
    w13, w2 = _expected(gate_up, down, tp_rank, tp_size, ep_rank, ep_size)
    assert torch.equal(moe.w13_weight, w13) and torch.equal(moe.w2_weight, w2)
    assert model.received == ["model.language_model.norm.weight"]  # only the rest reaches SGLang's loader
    assert torch.equal(model.model.norm, norm)
    assert {"model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"} <= loaded
    assert moe.calls == 2 * 2 + 2 * 1  # the check: SGLang's loader on the first and last local expert only
    assert wrapped.stats.fast == 2 and wrapped.stats.declined == {} and wrapped.stats.load_weights_calls == 1
    assert wrapped.saves[-1]["fast"] == 2


def test_a_bf16_layer_gets_the_same_bits_as_sglangs_per_expert_load(wrapped):
    gate_up, down = _fused(experts=16, hidden=32, inter=8, seed=3)
    fast, slow = StandInMoE(16, 32, 8, dtype=torch.bfloat16), StandInMoE(16, 32, 8, dtype=torch.bfloat16)
    wrapped.cls(fast).load_weights([(f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)])
    SGLangLikeModel(slow).load_weights([(f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)])
    assert torch.equal(fast.w13_weight, slow.w13_weight) and torch.equal(fast.w2_weight, slow.w2_weight)


def test_a_nan_in_the_checked_experts_keeps_the_fast_path_on(wrapped, capsys):
    """A diverged policy's NaN is a value to load, not a layout disagreement: torch.equal(nan, nan) is False."""
    gate_up, down = _fused()
    gate_up[0, 1, 2] = gate_up[-1, 0, 0] = float("nan")  # the first and the last expert: the two the check reloads
    down[0, 3, 1] = float("nan")
    moe = StandInMoE(dtype=torch.float64)
    wrapped.cls(moe).load_weights([(f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)])
    assert wrapped.stats.disabled is None and wrapped.stats.fast == 2, wrapped.stats.as_dict()
    assert "fast expert load" not in capsys.readouterr().err
    w13, w2 = _expected(gate_up, down, 0, 1, 0, 1)
    assert torch.equal(moe.w13_weight.view(torch.int64), w13.view(torch.int64))  # bit for bit, the NaNs included
    assert torch.equal(moe.w2_weight.view(torch.int64), w2.view(torch.int64))
    assert moe.w13_weight.isnan().sum() == 2 and moe.w2_weight.isnan().sum() == 1


def test_same_bits_tells_nan_and_signed_zeros_apart_from_equal():
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    assert expert_load.same_bits(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    zeros = torch.tensor([0.0]), torch.tensor([-0.0])
    assert torch.equal(*zeros) and not expert_load.same_bits(*zeros)
    assert not expert_load.same_bits(torch.zeros(2), torch.zeros(2, dtype=torch.float64))  # dtypes differ
    assert expert_load.same_bits(torch.arange(3), torch.arange(3)) and not expert_load.same_bits(
        torch.arange(3), torch.arange(1, 4))


def test_a_layout_the_check_disagrees_with_switches_the_fast_path_off(wrapped, capsys):
    gate_up, down = _fused()
    moe = StandInMoE(up_first=True, dtype=torch.float64)  # a layout the plain-layout test does not see
    model = wrapped.cls(moe)
    model.load_weights([(f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)])
    assert "expert 0 differs from SGLang's own load" in wrapped.stats.disabled
    assert "fast expert load" in capsys.readouterr().err
    assert model.received == [f"{LAYER}.gate_up_proj", f"{LAYER}.down_proj"]  # SGLang's loader did both
    w13, w2 = _expected(gate_up, down, 0, 1, 0, 1)
    assert torch.equal(moe.w13_weight, torch.cat([w13[:, 4:], w13[:, :4]], dim=1))  # up rows first, everywhere
    assert torch.equal(moe.w2_weight, w2)
    assert wrapped.stats.fast == 0


@pytest.mark.parametrize("change, reason", [
    (lambda m: setattr(m, "quant_method", object()), "quantized experts"),
    (lambda m: setattr(m, "use_triton_kernels", True), "use_triton_kernels"),
    (lambda m: setattr(m, "use_padded_loading", True), "use_padded_loading"),
    (lambda m: setattr(m.moe_runner_config, "is_gated", False), "non-gated"),
    (lambda m: setattr(m.w13_weight, "weight_loader", lambda *a: None), "without FusedMoE.weight_loader"),
    (lambda m: setattr(m, "_map_global_expert_id_to_local_expert_id", lambda e: (e * 3) % 8), "shapes"),
])
def test_other_layouts_are_left_to_sglangs_loader(wrapped, change, reason):
    gate_up, _ = _fused()
    moe = StandInMoE(dtype=torch.float64)
    change(moe)
    model = wrapped.cls(moe)
    model.load_weights([(f"{LAYER}.gate_up_proj", gate_up)])
    assert model.received == [f"{LAYER}.gate_up_proj"]
    assert [r for r in wrapped.stats.declined if reason in r] and wrapped.stats.fast == 0


def _set_expert_location(monkeypatch, metadata):
    """Make ``get_global_expert_location_metadata()`` return ``metadata``, with or without SGLang installed."""
    if importlib.util.find_spec("sglang") is None:
        for name in ("sglang", "sglang.srt", "sglang.srt.eplb"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        module = types.ModuleType("sglang.srt.eplb.expert_location")
        monkeypatch.setitem(sys.modules, module.__name__, module)
    else:
        module = importlib.import_module("sglang.srt.eplb.expert_location")
    monkeypatch.setattr(module, "get_global_expert_location_metadata", lambda: metadata, raising=False)


def _location(physical_to_logical, logical=8):
    """Expert-location metadata as SGLang keeps it, as far as the fast path reads it."""
    row = torch.tensor(physical_to_logical)
    return types.SimpleNamespace(physical_to_logical_map_cpu=row[None], num_physical_experts=row.numel(),
                                 num_logical_experts=logical)


@pytest.mark.parametrize("physical_to_logical, reason", [
    (list(range(8)), None),                      # SGLang's trivial metadata, set on every MoE server
    ([1, 0, 2, 3, 4, 5, 6, 7], "EPLB expert remapping"),
    (list(range(8)) + [0, 1], "EPLB redundant experts"),
])
def test_expert_location_metadata_is_fast_only_when_it_is_the_identity(wrapped, monkeypatch, physical_to_logical,
                                                                       reason):
    _set_expert_location(monkeypatch, _location(physical_to_logical))
    gate_up, down = _fused()
    moe = StandInMoE(dtype=torch.float64)
    model = wrapped.cls(moe)
    model.load_weights([(f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)])
    if reason is None:
        w13, w2 = _expected(gate_up, down, 0, 1, 0, 1)
        assert wrapped.stats.fast == 2 and not wrapped.stats.declined
        assert torch.equal(moe.w13_weight, w13) and torch.equal(moe.w2_weight, w2)
    else:
        assert wrapped.stats.fast == 0 and set(wrapped.stats.declined) == {reason}, wrapped.stats.as_dict()
        assert model.received == [f"{LAYER}.gate_up_proj", f"{LAYER}.down_proj"]


def test_a_layer_past_the_metadatas_layers_is_the_identity(wrapped, monkeypatch):
    _set_expert_location(monkeypatch, _location([1, 0, 2, 3, 4, 5, 6, 7]))  # layer 0 remapped
    moe = StandInMoE(dtype=torch.float64)
    moe.layer_id = 3  # SGLang's fallback for a layer the map does not cover (draft layers): logical e -> [e]
    gate_up, _ = _fused()
    wrapped.cls(moe).load_weights([(f"{LAYER}.gate_up_proj", gate_up)])
    assert wrapped.stats.fast == 1 and torch.equal(moe.w13_weight, _expected(gate_up, _fused()[1], 0, 1, 0, 1)[0])


def test_a_loader_that_writes_nothing_cannot_pass_the_check(wrapped):
    class Silent(StandInMoE):
        def weight_loader(self, param, loaded, name, shard_id, expert):  # e.g. maps the expert elsewhere
            self.calls += 1

    gate_up, _ = _fused()
    model = wrapped.cls(Silent(dtype=torch.float64))
    model.load_weights([(f"{LAYER}.gate_up_proj", gate_up)])
    assert "differs from SGLang's own load" in wrapped.stats.disabled
    assert model.received == [f"{LAYER}.gate_up_proj"] and wrapped.stats.fast == 0


def test_a_tensor_with_another_expert_count_is_left_to_sglangs_loader(wrapped):
    gate_up, _ = _fused(experts=4)
    model = wrapped.cls(StandInMoE(experts=8, ep_rank=0, ep_size=2, dtype=torch.float64))  # 4 local of 8
    model.load_weights([(f"{LAYER}.gate_up_proj", gate_up)])
    assert [r for r in wrapped.stats.declined if "number of experts" in r] and wrapped.stats.fast == 0


def test_the_weights_stream_through_in_order(wrapped):
    """Each tensor is loaded before the next one is pulled (a load from disk is never held whole)."""
    gate_up, down = _fused()
    events = []

    def weights():
        for name, tensor in ((f"{LAYER}.gate_up_proj", gate_up), ("model.language_model.norm.weight", torch.ones(3)),
                             (f"{LAYER}.down_proj", down), ("model.language_model.norm.weight", torch.zeros(3))):
            events.append(f"pull {name}")
            yield name, tensor

    class Logging(SGLangLikeModel):
        def load_weights(self, weights):
            for name, _ in weights:
                events.append(f"load {name}")

    expert_load.wrap_load_weights(Logging, wrapped.stats)
    Logging(StandInMoE(dtype=torch.float64)).load_weights(weights())
    norm = "model.language_model.norm.weight"
    assert events == [f"pull {LAYER}.gate_up_proj", f"pull {norm}", f"load {norm}", f"pull {LAYER}.down_proj",
                      f"pull {norm}", f"load {norm}"]  # the experts fast-loaded as pulled, the rest passed on


def test_names_and_shapes_that_do_not_fit_are_left_to_sglangs_loader():
    stats = expert_load.ExpertLoadStats()

    class Recording(SGLangLikeModel):
        def load_weights(self, weights):  # what reaches SGLang's loader, loaded or not
            self.received += [name for name, _ in weights]

    expert_load.wrap_load_weights(Recording, stats)
    gate_up, down = _fused()
    model = Recording(StandInMoE(dtype=torch.float64))
    model.load_weights([("mtp.layers.0.mlp.experts.gate_up_proj", gate_up),  # no such layer here
                        (f"{LAYER}.gate_up_proj", gate_up[:, :6]),  # another intermediate size
                        (f"{LAYER}.down_proj", down[0]),  # 2-D
                        (f"{LAYER}.0.gate_proj.weight", gate_up[0, :4])])  # per expert: not ours
    assert len(model.received) == 4 and stats.fast == 0
    assert sum(stats.declined.values()) == 3 and stats.load_weights_calls == 1


def test_fused_target_and_renaming():
    assert expert_load.fused_target(f"{LAYER}.down_proj") == (LAYER, "w2_weight")
    assert expert_load.fused_target(f"{LAYER}.gate_up_proj") == (LAYER, "w13_weight")
    assert expert_load.fused_target(f"{LAYER}.0.down_proj.weight") is None
    model = SGLangLikeModel(StandInMoE())
    assert expert_load.resolve_layer(model, LAYER)[0] == "model.layers.0.mlp.experts"
    assert expert_load.resolve_layer(model, "model.layers.0.mlp.experts")[0] == "model.layers.0.mlp.experts"
    assert expert_load.resolve_layer(model, "model.language_model.layers.7.mlp.experts") is None


def _sglang_fused_moe(experts, hidden, inter, tp_rank, tp_size, ep_rank, ep_size, dtype):
    """SGLang's ``FusedMoE`` with its loading state set as on a CUDA rank (no process groups: ``__init__``
    needs SGLang's runtime), and its unquantized method's parameters."""
    layer_module = pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer")
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod as SGLangUnquantized

    layer = layer_module.FusedMoE.__new__(layer_module.FusedMoE)
    torch.nn.Module.__init__(layer)
    local = experts // ep_size
    layer.__dict__.update(
        quant_config=None, quant_method=SGLangUnquantized(), moe_tp_rank=tp_rank, moe_tp_size=tp_size,
        moe_ep_rank=ep_rank, moe_ep_size=ep_size, _expert_storage_rank=ep_rank, _num_global_routed=experts,
        _num_local_routed=local, num_local_experts=local, _has_fused_shared=False, num_fused_shared_experts=0,
        use_triton_kernels=False, use_flashinfer_trtllm_moe=False, use_presharded_weights=False,
        use_padded_loading=False,  # a cached property, True on CPU only (SGLang's CPU layout)
        intermediate_size_per_partition=inter // tp_size, hidden_size=hidden,
        moe_runner_config=types.SimpleNamespace(is_gated=True), layer_id=0)
    shard = inter // tp_size
    for name, shape in (("w13_weight", (local, 2 * shard, hidden)), ("w2_weight", (local, hidden, shard))):
        param = torch.nn.Parameter(torch.full(shape, float("nan"), dtype=dtype), requires_grad=False)
        layer.register_parameter(name, param)
        param.weight_loader = layer.weight_loader
    return layer


@pytest.mark.parametrize("tp_rank, tp_size, ep_rank, ep_size", [(0, 1, 0, 1), (1, 2, 0, 1), (1, 2, 1, 2)])
def test_against_sglangs_own_fused_moe_weight_loader(tp_rank, tp_size, ep_rank, ep_size):
    stats = expert_load.ExpertLoadStats()
    gate_up, down = _fused(experts=8, hidden=16, inter=8, seed=5)
    fast = _sglang_fused_moe(8, 16, 8, tp_rank, tp_size, ep_rank, ep_size, torch.bfloat16)
    slow = _sglang_fused_moe(8, 16, 8, tp_rank, tp_size, ep_rank, ep_size, torch.bfloat16)
    model = SGLangLikeModel(fast)
    for name, tensor in ((f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)):
        assert expert_load.fast_load(model, name, tensor, stats), stats.as_dict()
    SGLangLikeModel(slow).load_weights([(f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)])
    assert torch.equal(fast.w13_weight, slow.w13_weight) and torch.equal(fast.w2_weight, slow.w2_weight)
    w13, w2 = _expected(gate_up, down, tp_rank, tp_size, ep_rank, ep_size)
    assert torch.equal(fast.w13_weight, w13.to(torch.bfloat16)) and torch.equal(fast.w2_weight, w2.to(torch.bfloat16))


def test_sglangs_qwen35_moe_load_weights_with_the_wrapper():
    """SGLang's real ``Qwen3_5MoeForConditionalGeneration.load_weights`` on a model holding only what these names
    need: wrapped, the experts are fast-loaded and the norm still reaches SGLang's loader; the result equals the
    unwrapped method's."""
    qwen3_5 = pytest.importorskip("sglang.srt.models.qwen3_5")
    original = qwen3_5.Qwen3_5MoeForConditionalGeneration.load_weights

    def model():
        m = SGLangLikeModel(_sglang_fused_moe(8, 16, 8, 0, 1, 0, 1, torch.bfloat16))
        m.config = types.SimpleNamespace(num_experts=8, tie_word_embeddings=False, encoder_only=False)
        m.enable_shared_expert_fusion, m.num_fused_shared_experts = False, 0
        m.pp_group = types.SimpleNamespace(is_last_rank=True)
        m.model.norm.weight_loader = lambda param, w: param.data.copy_(w)
        return m

    gate_up, down = _fused(experts=8, hidden=16, inter=8, seed=7)
    names = [(f"{LAYER}.gate_up_proj", gate_up), ("model.language_model.norm", torch.arange(3.0)),
             (f"{LAYER}.down_proj", down)]
    slow, fast = model(), model()
    original(slow, iter(names))
    cls = type("Wrapped", (SGLangLikeModel,), {"load_weights": original})
    stats = expert_load.ExpertLoadStats()
    expert_load.wrap_load_weights(cls, stats)
    fast.__class__ = cls
    loaded = fast.load_weights(iter(names))
    assert stats.fast == 2, stats.as_dict()
    moe_fast, moe_slow = fast.model.layers[0].mlp.experts, slow.model.layers[0].mlp.experts
    assert torch.equal(moe_fast.w13_weight, moe_slow.w13_weight) and torch.equal(moe_fast.w2_weight, moe_slow.w2_weight)
    assert torch.equal(fast.model.norm, torch.arange(3.0)) and "model.norm" in loaded


@pytest.mark.parametrize("remapped", [False, True])
def test_with_sglangs_own_expert_location_metadata(monkeypatch, remapped):
    """SGLang's ``ExpertLocationMetadata`` (trivial, as every MoE server has it, or with experts 3 and 4
    swapped) seen by both SGLang's ``FusedMoE.weight_loader`` and the fast path: trivial is fast-loaded and
    equals SGLang's load; swapped is declined by name and left to SGLang's loader (the check against SGLang's
    loader looks at the first and last expert only, so a swap of middle experts is this guard's alone)."""
    location = pytest.importorskip("sglang.srt.eplb.expert_location")
    layer_module = pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer")
    physical = torch.tensor([[0, 1, 2, 4, 3, 5, 6, 7]] if remapped else [list(range(8))])
    all_physical = torch.full((1, 8, 8), -1)  # logical e -> its physical slots, padded with -1 (SGLang's form)
    all_physical[0, :, 0] = torch.argsort(physical[0])  # a permutation: one slot each
    metadata = location.ExpertLocationMetadata(
        physical_to_logical_map=physical, physical_to_logical_map_cpu=physical,
        logical_to_all_physical_map=all_physical, logical_to_all_physical_map_cpu=all_physical,
        logical_to_all_physical_map_num_valid=torch.ones(1, 8, dtype=torch.long), ep_size=1,
        logical_to_rank_dispatch_physical_map=None)
    for module in (location, layer_module):
        monkeypatch.setattr(module, "get_global_expert_location_metadata", lambda: metadata)
    gate_up, down = _fused(experts=8, hidden=16, inter=8, seed=9)
    names = [(f"{LAYER}.gate_up_proj", gate_up), (f"{LAYER}.down_proj", down)]
    stats = expert_load.ExpertLoadStats()
    cls = type("Wrapped", (SGLangLikeModel,), {})
    expert_load.wrap_load_weights(cls, stats)
    fast = cls(_sglang_fused_moe(8, 16, 8, 0, 1, 0, 1, torch.bfloat16))
    slow = SGLangLikeModel(_sglang_fused_moe(8, 16, 8, 0, 1, 0, 1, torch.bfloat16))
    fast.load_weights(names)
    slow.load_weights(names)
    assert stats.fast == (0 if remapped else 2), stats.as_dict()
    assert stats.declined == ({"EPLB expert remapping": 2} if remapped else {}), stats.as_dict()
    moe_fast, moe_slow = fast.model.layers[0].mlp.experts, slow.model.layers[0].mlp.experts
    assert torch.equal(moe_fast.w13_weight, moe_slow.w13_weight) and torch.equal(moe_fast.w2_weight, moe_slow.w2_weight)
    if remapped:  # SGLang put logical expert 3 into physical slot 4
        assert torch.equal(moe_slow.w13_weight[4, :8].double(), gate_up[3, :8].to(torch.bfloat16).double())
