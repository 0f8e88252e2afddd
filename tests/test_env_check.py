"""The GPU start-up check for the torch 2.9 Conv3d / cuDNN slowdown (pytorch/pytorch#168167)."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch

from slime.utils import env_check
from slime.utils.env_check import check_environment, cudnn_conv3d_warning, decode_cudnn_version


@pytest.mark.parametrize(
    "encoded, version",
    [
        # cuDNN >= 9: major * 10000 + minor * 100 + patch (cudnn_version.h)
        (91600, (9, 16, 0)),
        (91002, (9, 10, 2)),
        (90100, (9, 1, 0)),
        (92000, (9, 20, 0)),
        # cuDNN <= 8: major * 1000 + minor * 100 + patch
        (8907, (8, 9, 7)),
        (8700, (8, 7, 0)),
        (7605, (7, 6, 5)),
    ],
)
def test_decode_cudnn_version(encoded, version):
    assert decode_cudnn_version(encoded) == version


@pytest.mark.parametrize("bad", [0, -91600, True, "91600", 9.16])
def test_decode_cudnn_version_rejects_non_versions(bad):
    with pytest.raises(ValueError, match="positive integer"):
        decode_cudnn_version(bad)


@pytest.mark.parametrize(
    "torch_version, cudnn, fragments",
    [
        # torch 2.9.1 falls back to the slow kernel for cuDNN 9.8 - 9.14
        ("2.9.1+cu128", 91002, ["cuDNN 9.10.2", "pip install nvidia-cudnn-cu12==9.16.0.29", "issues/168167"]),
        ("2.9.1+cu128", 90800, ["cuDNN 9.8.0", "nvidia-cudnn-cu12==9.16.0.29"]),
        ("2.9.1+cu128", 91400, ["cuDNN 9.14.0"]),
        ("2.9.1", 91300, ["nvidia-cudnn-cu12==9.16.0.29"]),
        ("2.9.1+cu130", 91300, ["pip install nvidia-cudnn-cu13==9.16.0.29"]),  # CUDA 13 wheels
        # torch 2.9.0 judges by the cuDNN it was built with: a new cuDNN alone does not help
        ("2.9.0+cu128", 91002, ["upgrade to torch 2.9.1", "nvidia-cudnn-cu12==9.16.0.29"]),
        ("2.9.0+cu128", 91600, ["torch 2.9.0+cu128 with cuDNN 9.16.0", "upgrade to torch 2.9.1"]),
        ("2.9.0a0+gitabc123", 91002, ["upgrade to torch 2.9.1"]),
        # later releases keep 2.9.1's run-time bypass: affected whenever cuDNN 9.8 - 9.14 is installed
        ("2.10.0+cu128", 91002, ["cuDNN 9.10.2", "nvidia-cudnn-cu12==9.16.0.29"]),
        ("2.11.0+cu130", 91400, ["cuDNN 9.14.0", "nvidia-cudnn-cu13==9.16.0.29"]),  # the GPU image's torch
        ("2.13.0+cu130", 90800, ["cuDNN 9.8.0"]),  # the newest pinned torch
        ("2.12.0.dev20260301+cu130", 91300, ["cuDNN 9.13.0"]),  # a nightly
    ],
)
def test_known_bad_pairs_warn_with_the_fix(torch_version, cudnn, fragments):
    warning = cudnn_conv3d_warning(torch_version, cudnn)
    assert warning is not None
    assert f"torch {torch_version}" in warning and "Conv3d" in warning
    for fragment in fragments:
        assert fragment in warning


@pytest.mark.parametrize(
    "torch_version, cudnn",
    [
        ("2.9.1+cu128", 91600),  # the recipe's cuDNN
        ("2.9.1+cu128", 91500),  # torch 2.9.1 uses cuDNN again from 9.15
        ("2.9.1+cu130", 92000),
        ("2.9.1+cu128", 90705),  # below 9.8 torch 2.9 keeps using cuDNN
        ("2.9.1+cu118", 8907),
        ("2.8.0+cu128", 91002),  # torch before 2.9 never bypasses cuDNN for this
        ("1.13.1+cu117", 8907),
        ("2.10.0+cu128", 91501),  # 2.10's own cuDNN pin (9.15.1)
        ("2.11.0+cu130", 91900),  # the GPU image
        ("2.13.0+cu130", 90705),
        ("2.13.0+cpu", None),
        ("2.9.1+cu128", None),  # no cuDNN: nothing to judge
    ],
)
def test_unaffected_pairs_do_not_warn(torch_version, cudnn):
    assert cudnn_conv3d_warning(torch_version, cudnn) is None


def test_check_environment_logs_and_returns_the_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    with caplog.at_level(logging.WARNING, logger=env_check.__name__):
        warning = check_environment()
    assert warning is not None and "cuDNN 9.10.2" in warning and "nvidia-cudnn-cu12==9.16.0.29" in warning
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [warning]


def test_check_environment_is_silent_for_a_good_pair(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91600)
    with caplog.at_level(logging.WARNING, logger=env_check.__name__):
        assert check_environment() is None
    assert not caplog.records


def test_check_environment_without_cuda_checks_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def fail():
        raise AssertionError("cuDNN must not be queried without CUDA")

    monkeypatch.setattr(torch.backends.cudnn, "version", fail)
    assert check_environment() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decoded_runtime_cudnn_matches_the_installed_wheel():
    """The encoding, checked against the real library: torch's integer vs the nvidia-cudnn wheel's version."""
    wheels = []
    for name in ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
        try:
            wheels.append(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            pass
    if not wheels:
        pytest.skip("cuDNN is not installed from an nvidia-cudnn wheel")
    decoded = decode_cudnn_version(torch.backends.cudnn.version())
    assert decoded in [tuple(int(part) for part in wheel.split(".")[:3]) for wheel in wheels]
