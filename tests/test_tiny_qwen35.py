"""The tiny Qwen3.5-MoE checkpoint: loads offline through the Auto classes, has the 35B-A3B
architecture scaled down, runs an image forward pass, and builds deterministically."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slime.checkpoints.tiny_qwen35 import TinyQwen35Options, build_tiny_checkpoint, ensure_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QWEN_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>", "<think>", "</think>",
]  # fmt: skip


def _config_json(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_loads_offline_through_auto_classes(tiny_ckpt):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    config = AutoConfig.from_pretrained(tiny_ckpt)
    assert type(config).__name__ == "Qwen3_5MoeConfig"
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert len(tokenizer) == config.text_config.vocab_size
    image_processor = AutoImageProcessor.from_pretrained(tiny_ckpt)  # PIL backend: no torchvision here
    assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert (image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size) == (16, 2, 2)
    assert (image_processor.size.shortest_edge, image_processor.size.longest_edge) == (32 * 32, 128 * 128)
    assert list(image_processor.image_mean) == [0.5, 0.5, 0.5] and list(image_processor.image_std) == [0.5, 0.5, 0.5]
    model = AutoModelForImageTextToText.from_pretrained(tiny_ckpt)
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_architecture_is_hybrid_moe_with_vision_tower(tiny_ckpt):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_ckpt)
    text = model.config.text_config
    layers = model.model.language_model.layers
    assert len(layers) == 4
    # 3 Gated-DeltaNet layers, then 1 full-attention layer with an output gate (q_proj emits query + gate).
    for layer in layers[:3]:
        assert type(layer.linear_attn).__name__ == "Qwen3_5MoeGatedDeltaNet" and not hasattr(layer, "self_attn")
    full = layers[3].self_attn
    assert not hasattr(layers[3], "linear_attn")
    assert full.q_proj.out_features == 2 * 4 * 32  # (query + gate) x 4 heads x head_dim 32
    assert full.k_proj.out_features == 2 * 32  # 2 KV heads
    # GDN dims: 2 key heads x 16, 4 value heads x 16, conv kernel 4 over q, k and v channels.
    gdn = layers[0].linear_attn
    assert gdn.conv1d.in_channels == 2 * 16 + 2 * 16 + 4 * 16 and gdn.conv1d.kernel_size == (4,)
    for layer in layers:
        moe = layer.mlp
        assert type(moe).__name__ == "Qwen3_5MoeSparseMoeBlock"
        assert moe.gate.weight.shape == (8, 64)  # router over 8 experts
        assert moe.experts.gate_up_proj.shape == (8, 2 * 32, 64)
        assert moe.shared_expert.down_proj.weight.shape == (64, 32)
        assert moe.shared_expert_gate.weight.shape == (1, 64)
    assert text.num_experts_per_tok == 2
    rope = text.rope_parameters
    assert rope["rope_theta"] == 1e7 and rope["partial_rotary_factor"] == 0.25
    # mRoPE sections cover the rotary frequencies: head_dim 32 * 0.25 = 8 rotary dims = 4 frequencies.
    assert sum(rope["mrope_section"]) == 32 * 0.25 / 2 and rope["mrope_interleaved"] is True
    vision = model.model.visual
    assert len(vision.blocks) == 2
    assert vision.merger.linear_fc2.out_features == text.hidden_size
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 2_000_000


def test_sglang_fields_and_token_ids_match_tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer

    raw = _config_json(tiny_ckpt)
    assert raw["text_config"]["full_attention_interval"] == 4
    assert raw["vision_config"]["deepstack_visual_indexes"] == []
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    tid = tokenizer.convert_tokens_to_ids
    assert raw["image_token_id"] == tid("<|image_pad|>")
    assert raw["video_token_id"] == tid("<|video_pad|>")
    assert raw["vision_start_token_id"] == tid("<|vision_start|>")
    assert raw["vision_end_token_id"] == tid("<|vision_end|>")
    assert raw["text_config"]["eos_token_id"] == tid("<|im_end|>") == tokenizer.eos_token_id
    assert raw["text_config"]["pad_token_id"] == tid("<|endoftext|>") == tokenizer.pad_token_id
    generation = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tid("<|im_end|>"), tid("<|endoftext|>")]


def test_folder_is_small_and_float32(tiny_ckpt):
    total = sum(f.stat().st_size for f in tiny_ckpt.iterdir())
    assert total < 5 * 2**20
    tensors = load_file(tiny_ckpt / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}


@pytest.mark.parametrize("token", QWEN_TOKENS)
def test_qwen_special_tokens_are_single_tokens(tiny_ckpt, token):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    ids = tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids(token) in ids
    assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1


def test_bpe_round_trips_geometry_text_and_keeps_think_tokens(tiny_ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    text = (
        "<think>\nIn $\\triangle ABC$, x = \\frac{5}{3}\\sqrt{2} ≈ 2.36°.\n</think>\nAnswer: \\boxed{12}<|im_end|>"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # <think> tokens are not "special" (as in Qwen3): they survive skip_special_tokens; <|im_end|> does not.
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")
    assert 2000 <= len(tokenizer) <= 4096


def test_chat_template_renders_qwen_format(tiny_ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]},
    ]
    prefix = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n"
    )
    render = lambda **kw: tokenizer.apply_chat_template(messages, tokenize=False, **kw)  # noqa: E731
    assert render(add_generation_prompt=True) == prefix + "<|im_start|>assistant\n<think>\n"
    assert render(add_generation_prompt=True, enable_thinking=False) == (
        prefix + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render(add_generation_prompt=False) == prefix


def test_image_forward_pass_gives_finite_logits(tiny_ckpt):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    model = AutoModelForImageTextToText.from_pretrained(tiny_ckpt).eval()
    cfg = model.config
    # One 64x96-pixel image (height x width): grid (t, h, w) = (1, 4, 6) patches of 16 px,
    # 24 patches -> 24 / 2**2 = 6 image tokens after the 2x2 merge.
    grid_thw = torch.tensor([[1, 4, 6]])
    pixel_values = torch.randn(24, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(0))
    text = "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>Find x.<|im_end|>\n"
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    mm_token_type_ids = (input_ids == cfg.image_token_id).long()
    with torch.no_grad():
        out = model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=grid_thw,
            mm_token_type_ids=mm_token_type_ids,
        )
    assert out.logits.shape == (1, input_ids.shape[1], cfg.text_config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # The image changes the logits (the vision tower is wired in): a different image, different logits.
    with torch.no_grad():
        other = model(
            input_ids=input_ids,
            pixel_values=pixel_values.flip(0),
            image_grid_thw=grid_thw,
            mm_token_type_ids=mm_token_type_ids,
        )
    assert not torch.allclose(out.logits[0, -1], other.logits[0, -1])


def test_same_seed_gives_bit_identical_build_and_other_seed_differs(tmp_path):
    a = build_tiny_checkpoint(tmp_path / "a", TinyQwen35Options(seed=3))
    b = build_tiny_checkpoint(tmp_path / "b", TinyQwen35Options(seed=3))
    c = build_tiny_checkpoint(tmp_path / "c", TinyQwen35Options(seed=4))
    ta, tb, tc = (load_file(p / "model.safetensors") for p in (a, b, c))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name].view(torch.int32), tb[name].view(torch.int32)), name
    for name in ["tokenizer.json", "config.json", "preprocessor_config.json", "chat_template.jinja"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not torch.equal(ta["lm_head.weight"], tc["lm_head.weight"])


def test_word_level_tokenizer_has_tiny_vocab(tmp_path):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    words = ["red", "green", "blue", "yellow"]
    folder = build_tiny_checkpoint(tmp_path / "w", TinyQwen35Options(vocab_words=tuple(words)))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # 8 Qwen special tokens + <think> + </think> + <unk> + "\n" + " " + system/user/assistant + 4 words.
    assert len(tokenizer) == 8 + 2 + 1 + 2 + 3 + 4
    assert AutoConfig.from_pretrained(folder).text_config.vocab_size == len(tokenizer)
    ids = tokenizer("red blue", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["red", " ", "blue"]
    assert tokenizer.decode(ids) == "red blue"
    assert tokenizer("purple", add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids("<unk>")]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "green"}], tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in prompt_ids
    assert tokenizer.decode(prompt_ids) == prompt
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert model.lm_head.out_features == len(tokenizer)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(vocab_words=()), "vocab_words is empty"),
        (dict(vocab_words=("red", "two words")), r"vocab_words\[1\] = 'two words'"),
        (dict(vocab_words=("red", "red")), r"vocab_words\[1\] = 'red' is a duplicate"),
        (dict(vocab_words=("user",)), r"vocab_words\[0\] = 'user' is already"),
        (dict(bpe_vocab_size=100), "bpe_vocab_size = 100"),
        (dict(min_pixels=16 * 16), "min_pixels = 256"),
        (dict(min_pixels=64 * 64, max_pixels=32 * 32), "max_pixels = 1024 is below min_pixels = 4096"),
    ],
)
def test_bad_options_raise_naming_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        TinyQwen35Options(**options)


def test_bpe_vocab_size_beyond_corpus_raises(tmp_path):
    with pytest.raises(RuntimeError, match="bpe_vocab_size = 100000"):
        build_tiny_checkpoint(tmp_path / "x", TinyQwen35Options(bpe_vocab_size=100_000))


def test_build_refuses_non_empty_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not empty"):
        build_tiny_checkpoint(tmp_path / "x")


def test_ensure_reuses_cache_and_keys_on_options(tmp_path):
    first = ensure_tiny_checkpoint(tmp_path, seed=1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(tmp_path, seed=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    other = ensure_tiny_checkpoint(tmp_path, seed=1, max_pixels=64 * 64)
    assert other != first and json.loads((other / "preprocessor_config.json").read_text())["size"] == {
        "shortest_edge": 32 * 32,
        "longest_edge": 64 * 64,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no temp dirs left


def _ensure_in_child(cache_dir: str, queue) -> None:
    queue.put(str(ensure_tiny_checkpoint(cache_dir, seed=2)))


def test_ensure_is_safe_when_two_processes_race(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    paths = {queue.get(timeout=5), queue.get(timeout=5)}
    assert len(paths) == 1
    (path,) = paths
    assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]
    assert load_file(Path(path) / "model.safetensors")  # complete and readable


def test_chat_template_rejects_unknown_content_and_tools(tiny_ckpt):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    with pytest.raises(Exception, match="content items must be text, image or video; got keys type, audio"):
        messages = [{"role": "user", "content": [{"type": "audio", "audio": "x.wav"}]}]
        tokenizer.apply_chat_template(messages, tokenize=False)
    with pytest.raises(Exception, match="does not render tools"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"name": "f"}], tokenize=False)


def test_cli_builds_into_out_and_needs_force_to_replace(tmp_path, capsys):
    import importlib.util

    from transformers import AutoConfig

    script = Path(__file__).parents[1] / "scripts" / "tools" / "make_tiny_qwen35.py"
    spec = importlib.util.spec_from_file_location("make_tiny_qwen35", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "tiny"
    assert cli.main(["--out", str(out), "--vocab-words", "red", "green", "--max-pixels", "4096"]) == out
    assert AutoConfig.from_pretrained(out).text_config.vocab_size == 16 + 2
    with pytest.raises(SystemExit):
        cli.main(["--out", str(out)])
    assert "pass --force" in capsys.readouterr().err
    cli.main(["--out", str(out), "--force"])
    assert AutoConfig.from_pretrained(out).text_config.vocab_size == 2048
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temp dirs left
