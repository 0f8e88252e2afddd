"""The real-width scaled Qwen3.5-35B-A3B: the released widths, a few layers and experts, random weights.

Hidden 2048, 16 query / 2 KV heads of 256 (25 % interleaved M-RoPE, sections [11, 11, 10]), Gated DeltaNet 16 key /
32 value heads of 128, top-8 routing over ``experts`` experts of width 512 plus a shared expert of 512, vocab
248,320 and the 27-block, 1152-wide vision tower, ``layers`` deep (every 4th layer full attention).  The checkpoint
holds random bf16 weights (seeded), the tokenizer, chat template and processor of the tiny real-geometry checkpoint
(:mod:`slime.checkpoints.tiny_qwen35`, images up to 512 x 512 px) and, by default, one random MTP layer of the
released shapes (:mod:`slime.checkpoints.mtp`).  At 4 layers and 128 experts that is 3.22 B parameters (6.4 GB) plus
0.44 B in the MTP layer: about 35 s on an H200, several minutes on a CPU.  ``scripts/models/qwen3.5-35B-A3B-scaled.sh``
holds its Megatron flags.  The GPU acceptance runs use it (``tests/test_sglang_gpu*.py``, ``scripts/bench/``).

Entry points: :func:`ensure_scaled_checkpoint` (cached under ``<repo>/.cache/scaled-qwen35/``),
:func:`build_scaled_checkpoint`, :func:`scaled_config` (the config alone, for models built in memory),
``scripts/tools/make_scaled_qwen35.py``.  Why a random model of the real widths: docs/design/tiny_qwen35.md.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from slime.checkpoints.tiny_qwen35 import (
    FULL_ATTENTION_INTERVAL,
    REAL_GEOMETRY_TEXT_CONFIG,
    TEXT_CONFIG,
    VISION_CONFIG,
    TinyQwen35Options,
    build_once,
    ensure_tiny_checkpoint,
)

BUILDER_VERSION = 1
"""Bump whenever the recipe changes (weights, config, files): cached folders rebuild."""

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "scaled-qwen35"
LAYERS = 4
EXPERTS = 128
TOKENIZER_SOURCE = TinyQwen35Options(real_geometry=True, max_pixels=512 * 512)
"""The tiny checkpoint whose tokenizer, chat template and processor files the scaled one ships."""

TEXT_WIDTHS = dict(hidden_size=2048, num_experts_per_tok=8, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512, vocab_size=248320)
"""Qwen3.5-35B-A3B's text widths beyond :data:`~slime.checkpoints.tiny_qwen35.REAL_GEOMETRY_TEXT_CONFIG`."""
VISION_WIDTHS = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                     num_position_embeddings=2304)
"""Qwen3.5-35B-A3B's vision tower (the merger's output at the text hidden size, no deepstack)."""
TOKEN_ID_KEYS = ("eos", "pad", "image", "video", "vision_start", "vision_end")
_SKIPPED_SOURCE_FILES = ("config.json", "model.safetensors", "generation_config.json")


def scaled_config(layers: int = LAYERS, experts: int = EXPERTS, token_ids: Mapping[str, int] | None = None):
    """The ``transformers.Qwen3_5MoeConfig`` of the scaled model (module docstring), bf16.

    Args:
        layers: decoder layers; layer ``i`` is full attention when ``(i + 1) % 4 == 0``, else Gated DeltaNet.
        experts: routed experts per layer (top-8).
        token_ids: the ids of the shipped tokenizer under :data:`TOKEN_ID_KEYS` (:func:`tokenizer_token_ids`);
            None: transformers' defaults, the released model's vision ids (248,053 and up, above ``vocab - 1000``,
            so random token ids below that never hit them) and no eos / pad id.

    Raises:
        ValueError: ``layers`` below 1, ``experts`` below the top-k 8, or a key of :data:`TOKEN_ID_KEYS` missing
            from ``token_ids`` (naming it).
    """
    from transformers import Qwen3_5MoeConfig

    if layers < 1:
        raise ValueError(f"layers = {layers}: the scaled model needs at least one layer")
    if experts < TEXT_WIDTHS["num_experts_per_tok"]:
        raise ValueError(f"experts = {experts}: the router picks {TEXT_WIDTHS['num_experts_per_tok']} per token, so "
                         "at least that many are needed")
    missing = [key for key in TOKEN_ID_KEYS if token_ids is not None and key not in token_ids]
    if missing:
        raise ValueError(f"token_ids lacks {', '.join(missing)} (needs {', '.join(TOKEN_ID_KEYS)})")
    text = copy.deepcopy(TEXT_CONFIG)
    text.update(copy.deepcopy(REAL_GEOMETRY_TEXT_CONFIG), **TEXT_WIDTHS, num_hidden_layers=layers,
                num_experts=experts, dtype="bfloat16",
                layer_types=["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
                             for i in range(layers)])
    ids = {}
    if token_ids is not None:
        text.update(eos_token_id=token_ids["eos"], pad_token_id=token_ids["pad"], bos_token_id=None)
        ids = dict(image_token_id=token_ids["image"], video_token_id=token_ids["video"],
                   vision_start_token_id=token_ids["vision_start"], vision_end_token_id=token_ids["vision_end"])
    vision = dict(copy.deepcopy(VISION_CONFIG), **VISION_WIDTHS)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="bfloat16",
                              **ids)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    config.text_config.full_attention_interval = FULL_ATTENTION_INTERVAL  # read by SGLang
    return config


def tokenizer_token_ids(folder: str | os.PathLike) -> dict[str, int]:
    """The :data:`TOKEN_ID_KEYS` ids of a Qwen3.5 checkpoint folder, from its ``config.json``."""
    config = json.loads((Path(folder) / "config.json").read_text())
    text = config["text_config"]
    return {"eos": text["eos_token_id"], "pad": text["pad_token_id"], "image": config["image_token_id"],
            "video": config["video_token_id"], "vision_start": config["vision_start_token_id"],
            "vision_end": config["vision_end_token_id"]}


def default_device() -> str:
    """Where the weights are drawn unless told: ``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_scaled_checkpoint(out: str | os.PathLike, layers: int = LAYERS, experts: int = EXPERTS, mtp: bool = True,
                            *, device: str | None = None, seed: int = 0) -> Path:
    """Write the scaled checkpoint folder ``out``: ``config.json`` (:func:`scaled_config` with the shipped
    tokenizer's ids), bf16 safetensors in shards of at most 4 GB with their index, the tokenizer, chat template and
    processor files, and with ``mtp`` one MTP layer (``mtp.safetensors``, ``text_config.mtp_num_hidden_layers`` 1).

    The weights are transformers' initialisation after ``torch.manual_seed(seed)``, drawn on ``device`` (default
    :func:`default_device`), the MTP layer's from ``seed`` too: the same arguments on the same kind of device give
    the same files.  Returns ``Path(out)``.

    Raises:
        FileExistsError: ``out`` exists and is not empty.
        ValueError: see :func:`scaled_config`.
    """
    from transformers import Qwen3_5MoeForConditionalGeneration

    from slime.checkpoints.mtp import write_mtp_layer

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose an empty folder or delete it first")
    device = device or default_device()
    source = ensure_tiny_checkpoint(**dataclasses.asdict(TOKENIZER_SOURCE))
    config = scaled_config(layers, experts, tokenizer_token_ids(source))
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5MoeForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default_dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the caller's process goes on (tests start servers on the same GPU)
    for path in source.iterdir():
        if path.is_file() and path.name not in _SKIPPED_SOURCE_FILES:
            shutil.copy(path, out / path.name)
    if mtp:
        write_mtp_layer(out, seed=seed, device=device)
    return out


def cache_name(layers: int = LAYERS, experts: int = EXPERTS, mtp: bool = True, device: str | None = None,
               seed: int = 0) -> str:
    """Folder name under the cache dir: the shape, the device kind (its random numbers differ) and a hash of
    everything the files depend on (:data:`BUILDER_VERSION`, the tokenizer source's own cache name)."""
    kind = torch.device(device or default_device()).type
    payload = json.dumps({"builder_version": BUILDER_VERSION, "tokenizer": TOKENIZER_SOURCE.cache_name(),
                          "layers": layers, "experts": experts, "mtp": mtp, "device": kind, "seed": seed},
                         sort_keys=True)
    digest = hashlib.sha256(payload.encode()).hexdigest()[:12]
    return f"l{layers}-e{experts}{'-mtp' if mtp else ''}-{kind}-seed{seed}-{digest}"


def ensure_scaled_checkpoint(cache_dir: str | os.PathLike | None = None, *, layers: int = LAYERS,
                             experts: int = EXPERTS, mtp: bool = True, device: str | None = None,
                             seed: int = 0) -> Path:
    """The cached scaled checkpoint of these arguments (:func:`build_scaled_checkpoint`), built once
    (:func:`~slime.checkpoints.tiny_qwen35.build_once`) under ``cache_dir`` (default
    ``<repo>/.cache/scaled-qwen35``) as :func:`cache_name`.

    Raises:
        ValueError: see :func:`scaled_config`.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    return build_once(cache_dir / cache_name(layers, experts, mtp, device, seed),
                      lambda tmp: build_scaled_checkpoint(tmp, layers, experts, mtp, device=device, seed=seed))
