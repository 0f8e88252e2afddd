"""A local Hugging Face model folder: the one reader of its ``config.json`` and the one check that a folder is one.

Every module that needs a field of ``config.json`` (the MODEL_ARGS check, the Megatron backend's layout check,
the native model's config, the fused-expert count of weight sync) reads the file with :func:`read_config` and
finds fields with :func:`lookup` / :func:`text_fields`: a vision-language config (Qwen3.5-MoE) keeps the
language model's fields under ``text_config``, so a field is taken from ``text_config`` first, then from the
top level.  Every check that a flag names a model folder (``--hf-checkpoint``, a ``--load`` or ``--ref-load``
Hugging Face folder, the processor's files) is :func:`check_hf_folder`.  Imports no torch or transformers.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any, Mapping

from slime.checkpoints.layout import CheckpointError

CONFIG_FILE = "config.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
"""Weight files of a Hugging Face folder (sharded or not)."""
PROCESSOR_FILES = ("tokenizer_config.json", "preprocessor_config.json")
"""Files the vision-language processor reads (:func:`slime.data.processor.load_processor`)."""
TOKENIZER_MODEL_FILES = ("tokenizer.json", "vocab.json")
"""At least one of these holds the tokenizer's vocabulary."""

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "absent"})()
"""What :func:`lookup` returns for a field the config does not have."""


class HFFolderError(CheckpointError, FileNotFoundError):
    """A folder a flag names is not a local Hugging Face model folder, or lacks a file; the message
    names the flag, the folder and what is missing."""


def has_config(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a ``config.json`` (a Hugging Face folder, not a slime checkpoint root)."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_config(path: str | os.PathLike, flag: str = "--hf-checkpoint") -> dict | None:
    """``<path>/config.json`` as a dict; ``None`` when there is none (a hub name, a folder made later).

    Raises:
        CheckpointError: ``config.json`` exists but is not a readable JSON object (naming ``flag``).
    """
    config_file = Path(path) / CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{flag} {path}: cannot read {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{flag} {path}: {config_file} is not a JSON object")
    return config


def require_config(path: str | os.PathLike, flag: str = "--hf-checkpoint") -> dict:
    """:func:`read_config` of a folder that must have one; raises :class:`HFFolderError` when it has none."""
    config = read_config(path, flag)
    if config is None:
        raise HFFolderError(f"{flag} {path}: {CONFIG_FILE} is missing; this is not a Hugging Face model folder")
    return config


def text_fields(config: Mapping) -> Mapping[str, Any]:
    """The language model's fields: ``text_config``'s, then the top level's for those it lacks."""
    text = config.get("text_config")
    return collections.ChainMap(text, config) if isinstance(text, Mapping) else config


def lookup(config: Mapping, *paths: str) -> tuple[str, Any]:
    """The first of ``paths`` present in the config, ``text_config`` searched before the top level.

    Args:
        config: a ``config.json`` dict.
        paths: field names; a dot goes into a nested dict (``"rope_parameters.rope_theta"``).

    Returns:
        ``(qualified name, value)``, e.g. ``("text_config.head_dim", 256)``; ``(paths[0], MISSING)``
        when none is present.
    """
    text = config.get("text_config")
    sections = ([("text_config.", text)] if isinstance(text, Mapping) else []) + [("", config)]
    for prefix, section in sections:
        for path in paths:
            value: Any = section
            for key in path.split("."):
                value = value.get(key, MISSING) if isinstance(value, Mapping) else MISSING
            if value is not MISSING:
                return prefix + path, value
    return paths[0], MISSING


def check_hf_folder(
    path: str | os.PathLike, flag: str = "--hf-checkpoint", *, weights: bool = True, processor: bool = False
) -> Path:
    """Check that ``path`` is a local Hugging Face model folder: a folder with a ``config.json``.

    Args:
        path: the folder.
        flag: the flag that named it, for messages.
        weights: also require weight files (:data:`WEIGHT_PATTERNS`).
        processor: also require the processor's files (:data:`PROCESSOR_FILES` and one of
            :data:`TOKENIZER_MODEL_FILES`).

    Returns:
        ``path`` as a ``Path``.

    Raises:
        HFFolderError: naming ``flag``, the folder and the first thing missing.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise HFFolderError(
            f"{flag} {path}: no such folder (it does not exist or is not a folder); give a local Hugging Face "
            f"model folder (download a hub model there first, e.g. `hf download <repo> --local-dir {path}`)"
        )
    if not has_config(folder):
        raise HFFolderError(f"{flag} {path}: {CONFIG_FILE} is missing; this is not a Hugging Face model folder")
    if weights and not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise HFFolderError(f"{flag} {path}: no weights ({' or '.join(WEIGHT_PATTERNS)}) in the folder")
    if processor:
        for name in PROCESSOR_FILES:
            if not (folder / name).is_file():
                raise HFFolderError(f"{flag} {str(path)!r} has no {name}; it is not a complete HF checkpoint")
        if not any((folder / name).is_file() for name in TOKENIZER_MODEL_FILES):
            raise HFFolderError(
                f"{flag} {str(path)!r} has none of {' / '.join(TOKENIZER_MODEL_FILES)}; "
                "copy the tokenizer files of the checkpoint"
            )
    return folder


def weights_bytes(path: str | os.PathLike) -> int:
    """Total size in bytes of the weight files (:data:`WEIGHT_PATTERNS`) of a Hugging Face folder."""
    folder = Path(path)
    return sum(f.stat().st_size for pattern in WEIGHT_PATTERNS for f in folder.glob(pattern))
