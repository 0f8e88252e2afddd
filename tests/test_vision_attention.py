"""The vision tower's attention over all images of a call at once (``slime.models.qwen3_5.vision``).

CPU: torch's ``varlen_attn`` is CUDA-only, so the plumbing is checked with it replaced by a float64 block-diagonal
attention written here; the reference is transformers' own SDPA path of the same tower (one call per image).
GPU (marked gpu): the real kernel in bf16 against the SDPA path in fp32, its error within max(2e-2, 1.5 x) SDPA's own
bf16 run's, for the features and every parameter's gradient.
"""

from __future__ import annotations

import pytest
import torch

from slime.models.qwen3_5 import vision as V

SMALL = dict(depth=3, hidden_size=64, hidden_act="gelu_pytorch_tanh", intermediate_size=96, num_heads=4, in_channels=3,
             patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=48,
             num_position_embeddings=64)
GRIDS = [[1, 4, 6], [1, 8, 4], [1, 2, 2], [1, 6, 6]]  # patches 24, 32, 4, 36


def _inputs(config: dict, grids, dtype, device="cpu", seed=0):
    grid = torch.tensor(grids, device=device)
    patches = int(grid.prod(-1).sum())
    width = config["in_channels"] * config["temporal_patch_size"] * config["patch_size"] ** 2
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(patches, width, generator=gen, device=device).to(dtype), grid


def _features_and_grads(tower, pixels, grid, implementation: str):
    """Merged features and every parameter's gradient of ``sum(features * weights)`` under ``implementation``."""
    V.use_vision_attention(tower, implementation)
    tower.zero_grad(set_to_none=True)
    features = V.image_features(tower, pixels, grid)
    weights = torch.linspace(-1, 1, features.numel(), device=features.device, dtype=torch.float64)
    (features.double().flatten() * weights).sum().backward()
    return features.detach().double(), {n: p.grad.double().clone() for n, p in tower.named_parameters()}


def test_one_varlen_call_per_block_gives_the_sdpa_features_and_gradients(monkeypatch):
    calls = []

    def block_diagonal_float64(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        """softmax(q k^T * scale) v within each [cu[i], cu[i+1]) block, in float64; q, k, v: [P, H, d]."""
        calls.append((tuple(q.shape), cu_q.tolist(), cu_k.tolist(), max_q, max_k, cu_q.dtype, window_size))
        bounds = cu_q.tolist()
        out = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            qi, ki, vi = (x[start:end].double().transpose(0, 1) for x in (q, k, v))
            out.append((torch.softmax(qi @ ki.transpose(1, 2) * scale, -1) @ vi).transpose(0, 1))
        return torch.cat(out).to(q.dtype)

    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", block_diagonal_float64)
    torch.manual_seed(0)
    tower = V.build_vision_tower(SMALL, dtype=torch.float64, device="cpu")
    pixels, grid = _inputs(SMALL, GRIDS, torch.float64)
    ref, ref_grads = _features_and_grads(tower, pixels, grid, "sdpa")
    assert not calls
    out, grads = _features_and_grads(tower, pixels, grid, V.VARLEN_VISION_ATTENTION)
    # one call per block over all 96 patches, the images' offsets by hand, int32 (FlashAttention's), no mask window
    head_dim = SMALL["hidden_size"] // SMALL["num_heads"]
    assert calls == [((96, 4, head_dim), [0, 24, 56, 60, 96], [0, 24, 56, 60, 96], 36, 36, torch.int32, (-1, -1))] * 3
    assert ref.shape == (96 // 4, SMALL["out_hidden_size"])
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max() <= 1e-10 * (1 + ref_grads[name].abs().max()), name


def test_the_model_kernel_picks_the_tower_attention():
    assert V.vision_attention_for("varlen") == V.VARLEN_VISION_ATTENTION
    assert V.vision_attention_for("sdpa") == "sdpa"
    tower = V.build_vision_tower(SMALL, dtype=torch.float32, device="cpu",
                                 attn_implementation=V.VARLEN_VISION_ATTENTION)
    # every block reads the one config object the switch sets
    assert {b.attn.config._attn_implementation for b in tower.blocks} == {V.VARLEN_VISION_ATTENTION}
    V.use_vision_attention(tower, "sdpa")
    assert {b.attn.config._attn_implementation for b in tower.blocks} == {"sdpa"}


def test_materialize_keeps_the_tower_attention():
    """A meta-built model's tower is rebuilt on the device with the attention it was built with."""
    from types import SimpleNamespace

    from slime.models.qwen3_5.weights import materialize

    with torch.device("meta"):
        tower = V.build_vision_tower(SMALL, dtype=torch.float32, attn_implementation=V.VARLEN_VISION_ATTENTION)
    model = torch.nn.Module()
    model.visual = tower
    model.qwen_config = SimpleNamespace(arch=SimpleNamespace(vision_config=SMALL))
    materialize(model, torch.device("cpu"))
    assert not any(p.is_meta for p in model.visual.parameters())
    assert model.visual.config._attn_implementation == V.VARLEN_VISION_ATTENTION


def test_a_device_tensor_max_length_is_read_once_per_call(monkeypatch):
    """transformers 5.12 hands ``max_length_q`` as a 0-dim tensor, recomputed per block from the call's one
    ``cu_seqlens``: the kernel gets an int, read once per ``cu_seqlens`` tensor."""
    seen, reads = [], []

    class Counted(torch.Tensor):  # a 0-dim max whose host reads are counted
        def item(self):
            reads.append(1)
            return super().item()

    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn",
                        lambda q, k, v, cu_q, cu_k, max_q, max_k, **kw: seen.append((max_q, max_k)) or q)
    q = torch.zeros(1, 2, 7, 8)
    cu = torch.tensor([0, 3, 7])
    for _ in range(3):  # three blocks of one call
        V.varlen_vision_attention(None, q, q, q, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                  max_length_q=torch.tensor(4).as_subclass(Counted),
                                  max_length_k=torch.tensor(4).as_subclass(Counted))
    assert seen == [(4, 4)] * 3 and all(type(m) is int for pair in seen for m in pair)
    assert len(reads) == 1
    other = torch.tensor([0, 5, 7])  # the next call's offsets: read again
    V.varlen_vision_attention(None, q, q, q, cu_seq_lens_q=other, max_length_q=torch.tensor(5).as_subclass(Counted))
    assert seen[-1] == (5, 5) and len(reads) == 2


def test_a_scale_this_torch_cannot_take_is_refused(monkeypatch):
    def no_scale(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):  # an older varlen_attn
        return q

    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", no_scale)
    q = torch.zeros(1, 2, 4, 16)
    cu = torch.tensor([0, 4])
    out, _ = V.varlen_vision_attention(None, q, q, q, scaling=0.25, cu_seq_lens_q=cu, max_length_q=4)  # 1/sqrt(16)
    assert out.shape == (1, 4, 2, 16)
    with pytest.raises(ValueError, match="no scale argument; scaling 0.5 is not 1/sqrt"):
        V.varlen_vision_attention(None, q, q, q, scaling=0.5, cu_seq_lens_q=cu, max_length_q=4)


def test_the_native_model_gives_its_tower_the_attention_of_its_kernels(tiny_ckpt):
    """``Qwen35Model`` builds the tower with :func:`vision_attention_for` of its ``kernels.attention``."""
    pytest.importorskip("megatron.core")
    from qwen35_helpers import megatron_on_cpu

    from slime.models.qwen3_5.config import Qwen35Kernels, qwen35_config_from_hf
    from slime.models.qwen3_5.model import Qwen35Model

    with megatron_on_cpu():
        for attention, want in (("varlen", V.VARLEN_VISION_ATTENTION), ("sdpa", "sdpa")):
            config = qwen35_config_from_hf(tiny_ckpt, params_dtype=torch.float32,
                                           kernels=Qwen35Kernels(gdn="torch", attention=attention),
                                           moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
                                           perform_initialization=False)
            assert Qwen35Model(config).visual.config._attn_implementation == want, attention


@pytest.mark.parametrize("options, match", [
    (dict(dropout=0.1), "dropout=0.1"),
    (dict(is_causal=True), "causal=True"),
    (dict(attention_mask=torch.ones(1)), "mask=True"),
])
def test_unsupported_calls_are_refused(options, match):
    q = torch.zeros(1, 2, 4, 8)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match=match):
        V.varlen_vision_attention(None, q, q, q, cu_seq_lens_q=cu, max_length_q=4, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_varlen_tower_matches_fp32_sdpa_at_real_width():
    """The scaled checkpoint's vision tower (27 blocks, width 1152, 16 heads of 72), 6 geo3k-sized images."""
    from slime.checkpoints.scaled_qwen35 import scaled_config

    config = scaled_config().vision_config.to_dict()
    grids = [[1, 36, 36], [1, 20, 28], [1, 32, 24], [1, 16, 16], [1, 36, 36], [1, 28, 20]]
    torch.manual_seed(0)
    tower = V.build_vision_tower(config, dtype=torch.float32, device="cuda")
    pixels, grid = _inputs(config, grids, torch.float32, device="cuda")
    ref, ref_grads = _features_and_grads(tower, pixels, grid, "sdpa")
    tower.to(torch.bfloat16)
    runs = {impl: _features_and_grads(tower, pixels.bfloat16(), grid, impl)
            for impl in ("sdpa", V.VARLEN_VISION_ATTENTION)}

    def errors(features, grads):
        out = ((features - ref).abs().max() / ref.abs().max()).item()
        grad = max(((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
                   for n, g in grads.items())
        return out, grad

    sdpa_out, sdpa_grad = errors(*runs["sdpa"])
    varlen_out, varlen_grad = errors(*runs[V.VARLEN_VISION_ATTENTION])
    print(f"FIGURE vision bf16 vs fp32: features sdpa {sdpa_out:.3e} varlen {varlen_out:.3e}; "
          f"worst parameter gradient sdpa {sdpa_grad:.3e} varlen {varlen_grad:.3e}")
    assert varlen_out <= max(2e-2, 1.5 * sdpa_out)
    assert varlen_grad <= max(2e-2, 1.5 * sdpa_grad)


def test_the_tower_bench_runs_on_cpu(tmp_path):
    """``scripts/bench/vision_tower.py`` (the GPU's ``vision`` phase) gets to its figures on CPU; the varlen variant,
    CUDA-only, is reported as an error row instead of stopping the script."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "vision_tower.py"
    out = tmp_path / "vision.jsonl"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--depth", "1", "--images", "3", "--images-per-call", "2",
         "--image-grid", "1", "4", "4", "--warmup", "1", "--steps", "1", "--variants", "sdpa", "varlen",
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    sdpa, varlen = (json.loads(line) for line in out.read_text().splitlines())
    assert (sdpa["variant"], sdpa["patches"], sdpa["max_rel_diff_vs_sdpa"]) == ("sdpa", 48, 0.0)
    assert sdpa["step_s"] > 0 and sdpa["patches_per_s"] == round(48 / sdpa["step_s"])
    assert varlen["variant"] == "varlen" and "flash" in varlen["error"].lower()
