"""slime.checkpoints.hf: the one reader of a Hugging Face folder's config.json and the one folder check."""

from __future__ import annotations

import json

import pytest

from slime.checkpoints.hf import (
    MISSING,
    HFFolderError,
    check_hf_folder,
    has_config,
    lookup,
    read_config,
    require_config,
    text_fields,
    weights_bytes,
)
from slime.checkpoints.layout import CheckpointError
from slime.errors import SlimeError

VL_CONFIG = {
    "model_type": "qwen3_5_moe", "tie_word_embeddings": False, "image_token_id": 7, "num_experts": 99,
    "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": 8,
                    "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}},
}  # fmt: skip


def test_read_config_missing_and_unreadable(tmp_path):
    assert read_config(tmp_path) is None and read_config(tmp_path / "absent") is None
    assert not has_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(VL_CONFIG))
    assert read_config(tmp_path) == VL_CONFIG == require_config(tmp_path) and has_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"--load {tmp_path}: cannot read {tmp_path}/config.json"):
        read_config(tmp_path, "--load")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is not a JSON object"):
        read_config(tmp_path)
    with pytest.raises(HFFolderError, match=r"--ref-load .*: config.json is missing"):
        require_config(tmp_path / "absent", "--ref-load")


def test_fields_are_taken_from_text_config_first_then_the_top_level():
    assert lookup(VL_CONFIG, "num_experts") == ("text_config.num_experts", 8)
    assert lookup(VL_CONFIG, "image_token_id") == ("image_token_id", 7)
    assert lookup(VL_CONFIG, "rope_parameters.rope_theta") == ("text_config.rope_parameters.rope_theta", 1e7)
    assert lookup(VL_CONFIG, "head_dim", "rope_theta") == ("head_dim", MISSING)
    assert lookup({"num_experts": 4}, "num_experts") == ("num_experts", 4)  # a text-only config
    text = text_fields(VL_CONFIG)
    assert (text["num_experts"], text["image_token_id"], text.get("head_dim")) == (8, 7, None)


def test_check_hf_folder_names_the_flag_and_what_is_missing(tmp_path):
    with pytest.raises(HFFolderError, match=r"--load .*nope: no such folder \(it does not exist or is not a folder\)"):
        check_hf_folder(tmp_path / "nope", "--load")
    with pytest.raises(HFFolderError, match="config.json is missing"):
        check_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert check_hf_folder(tmp_path, weights=False) == tmp_path
    with pytest.raises(HFFolderError, match=r"--hf-checkpoint .*: no weights \(\*.safetensors or \*.bin\)"):
        check_hf_folder(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 5)
    assert check_hf_folder(tmp_path) == tmp_path and weights_bytes(tmp_path) == 15
    with pytest.raises(HFFolderError, match="has no tokenizer_config.json"):
        check_hf_folder(tmp_path, processor=True)
    for name in ("tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(HFFolderError, match="has none of tokenizer.json / vocab.json"):
        check_hf_folder(tmp_path, processor=True)
    (tmp_path / "vocab.json").write_text("{}")
    assert check_hf_folder(tmp_path, processor=True) == tmp_path


def test_folder_errors_are_file_not_found_and_checkpoint_errors(tmp_path):
    # callers that catch FileNotFoundError (a missing file) or CheckpointError (a bad folder) both see it
    with pytest.raises(FileNotFoundError, match="--hf-checkpoint"):
        check_hf_folder(tmp_path, "--hf-checkpoint")
    assert issubclass(HFFolderError, CheckpointError) and issubclass(HFFolderError, SlimeError)
