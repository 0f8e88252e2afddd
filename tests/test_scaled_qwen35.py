"""The real-width scaled Qwen3.5-35B-A3B (slime/checkpoints/scaled_qwen35.py): its config against the model file
``scripts/models/qwen3.5-35B-A3B-scaled.sh`` through the model-flag checker, its size against the H200 build of
run 1 (docs/results/h200_real_width.md), and a CPU build through the same code path with 8 experts that
transformers loads and runs."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from slime.checkpoints import scaled_qwen35
from slime.checkpoints.scaled_qwen35 import (
    TOKENIZER_SOURCE,
    build_scaled_checkpoint,
    ensure_scaled_checkpoint,
    scaled_config,
    tokenizer_token_ids,
)

REPO = Path(__file__).resolve().parents[1]
SCALED_MODEL_FILE = REPO / "scripts" / "models" / "qwen3.5-35B-A3B-scaled.sh"
SMALL = dict(layers=4, experts=8)
"""The CPU build: the scaled model's widths and depth, 8 experts (1.7 B parameters, about a minute on 2 cores)."""


def _model_args(script: Path) -> list[str]:
    """MODEL_ARGS of a scripts/models/*.sh file, read by sourcing it with bash."""
    out = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\0" "${MODEL_ARGS[@]}"', "bash", str(script)],
                         capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


def _mismatches(config: dict) -> list[str]:
    """The model-flag checker's findings for the scaled model file's MODEL_ARGS against ``config`` (a config.json)."""
    from slime.checkpoints.model_args import ModelConfig
    from slime.checkpoints.model_args import model_args_mismatches
    from slime.utils.config import add_group, build_group

    parser = argparse.ArgumentParser()
    add_group(parser, ModelConfig, "MODEL_ARGS")
    return model_args_mismatches(build_group(ModelConfig, parser.parse_args(_model_args(SCALED_MODEL_FILE))), config)


@pytest.fixture(scope="module")
def token_ids() -> dict[str, int]:
    from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint

    return tokenizer_token_ids(ensure_tiny_checkpoint(real_geometry=True, max_pixels=512 * 512))


def test_the_scaled_model_file_describes_the_config(token_ids):
    assert _mismatches(scaled_config(4, 128, token_ids).to_dict()) == []
    # the checker compares what it should: a config of another depth and expert count is refused on exactly those
    assert _mismatches(scaled_config(8, 64, token_ids).to_dict()) == [
        "--num-layers 4 vs text_config.num_hidden_layers 8", "--num-experts 128 vs text_config.num_experts 64"]


def test_the_config_has_the_h200_builds_size(token_ids):
    """3,216,379,696 parameters and an MTP layer of 441.7 M: the figures of the checkpoint built on the H200 in run 1
    (docs/results/h200_real_width.md), counted here on the meta device."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    from slime.checkpoints.mtp import mtp_tensor_shapes

    config = scaled_config(4, 128, token_ids)
    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == 3_216_379_696
    mtp = mtp_tensor_shapes(config.text_config.to_dict())
    assert len(mtp) == 17 + 3 * 128
    assert round(sum(math.prod(s) for s in mtp.values()) / 1e6, 1) == 441.7
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == (8192, 2048)  # 16 heads of 256, each [query; gate]
    assert mtp["mtp.layers.0.mlp.gate.weight"] == (128, 2048) and mtp["mtp.fc.weight"] == (2048, 4096)


def test_without_the_tokenizers_ids_the_released_vision_ids_stay_clear_of_random_tokens():
    config = scaled_config(2, 8)
    ids = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    assert min(ids) >= config.text_config.vocab_size - 1000  # benchmarks draw random ids below vocab - 1000


@pytest.mark.parametrize("kwargs, match", [(dict(layers=0), "layers = 0"), (dict(experts=4), "experts = 4"),
                                           (dict(token_ids={"eos": 1}), "token_ids lacks pad, image")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scaled_config(**kwargs)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    """Slow (about 25 s on 2 cores): 1.7 B parameters at the real widths (vocab 248,320, the 27-block vision
    tower) drawn and saved on CPU; only the experts are cut (:data:`SMALL`)."""
    return build_scaled_checkpoint(tmp_path_factory.mktemp("scaled") / "e8", **SMALL, device="cpu")


@pytest.mark.slow
def test_a_cpu_build_loads_in_transformers_and_runs(small_ckpt, token_ids):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from slime.checkpoints.mtp import MTP_PREFIX, mtp_problem, mtp_tensor_shapes, safetensors_header
    from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint

    raw = json.loads((small_ckpt / "config.json").read_text())
    # only the expert count differs from the model file: the same code path as the 128-expert checkpoint
    assert _mismatches(raw) == ["--num-experts 128 vs text_config.num_experts 8"]
    assert tokenizer_token_ids(small_ckpt) == token_ids
    vision = raw["vision_config"]
    assert (vision["depth"], vision["hidden_size"], vision["out_hidden_size"], vision["deepstack_visual_indexes"]) == (
        27, 1152, 2048, [])
    assert (raw["text_config"]["dtype"], raw["text_config"]["full_attention_interval"]) == ("bfloat16", 4)
    assert mtp_problem(small_ckpt) is None
    source = ensure_tiny_checkpoint(real_geometry=True, max_pixels=512 * 512)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json"):
        assert (small_ckpt / name).read_bytes() == (source / name).read_bytes(), name
    headers = {n: e for f in small_ckpt.glob("*.safetensors") for n, e in safetensors_header(f).items()}
    assert {e["dtype"] for e in headers.values()} == {"BF16"}
    mtp = {n: tuple(e["shape"]) for n, e in headers.items() if n.startswith(MTP_PREFIX)}
    assert mtp == mtp_tensor_shapes(raw["text_config"])

    model, info = AutoModelForImageTextToText.from_pretrained(small_ckpt, dtype=torch.bfloat16,
                                                              output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert sum(p.numel() for p in model.parameters()) == sum(
        math.prod(e["shape"]) for n, e in headers.items() if not n.startswith(MTP_PREFIX))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tokenizer = AutoTokenizer.from_pretrained(small_ckpt)
    ids = tokenizer("the area of the triangle is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 248320) and torch.isfinite(logits.float()).all()


def _fake_build(built: list):
    """A stand-in for :func:`build_scaled_checkpoint` that writes one small safetensors file and records its call."""
    def build(out, layers, experts, mtp, *, device=None, seed=0):
        from safetensors.torch import save_file

        built.append((layers, experts, mtp, device, seed))
        Path(out).mkdir(parents=True, exist_ok=True)
        save_file({"w": torch.zeros(2, 3), "mtp.fc.weight": torch.zeros(5)}, str(Path(out) / "model.safetensors"))
        return Path(out)
    return build


def test_ensure_builds_once_per_shape_and_device(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(scaled_qwen35, "build_scaled_checkpoint", _fake_build(built))
    first = ensure_scaled_checkpoint(tmp_path, layers=4, experts=8, device="cpu")
    assert ensure_scaled_checkpoint(tmp_path, layers=4, experts=8, device="cpu") == first
    assert built == [(4, 8, True, "cpu", 0)]
    others = {ensure_scaled_checkpoint(tmp_path, layers=4, experts=16, device="cpu"),
              ensure_scaled_checkpoint(tmp_path, layers=4, experts=8, mtp=False, device="cpu"),
              ensure_scaled_checkpoint(tmp_path, layers=4, experts=8, device="cuda")}  # other random numbers
    assert len(others | {first}) == 4 and len(built) == 4
    assert first.name.startswith("l4-e8-mtp-cpu-seed0-") and TOKENIZER_SOURCE.real_geometry
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in others | {first})  # no temp dirs


def test_build_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        build_scaled_checkpoint(tmp_path, **SMALL, device="cpu")


def test_cli_prints_the_figures_and_the_folder(tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_scaled_qwen35", REPO / "scripts/tools/make_scaled_qwen35.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    built = []
    monkeypatch.setattr(cli, "build_scaled_checkpoint", _fake_build(built))
    out = cli.main([str(tmp_path / "out"), "--experts", "8", "--device", "cpu", "--no-mtp"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == str(out) == str(tmp_path / "out") and built == [(4, 8, False, "cpu", 0)]
    figures = json.loads(lines[-2])
    assert (figures["params"], figures["mtp_params"], figures["experts"]) == (6, 5, 8)
    with pytest.raises(SystemExit) as exit_info:  # a non-empty folder needs --force
        cli.main([str(out)])
    assert exit_info.value.code == 2 and "--force" in capsys.readouterr().err
    assert len(built) == 1
