"""Where the weights come from (:mod:`slime.backends.weight_sources`): one rule for ``--hf-checkpoint``,
``--load`` and ``--ref-load``, the same for both backends and the driver's log.

Fast: :func:`resolve_weights` on folders laid out here (a Hugging Face folder, a slime checkpoint root, a
missing folder, an empty one) and the driver's log line.  Slow (2 ranks each): each backend started with
``--load`` / ``--ref-load`` of a Hugging Face folder whose weights this test perturbed, of a checkpoint root,
and of a missing folder, its policy and reference weights compared with the files on disk.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.backends.config import CheckpointConfig
from slime.backends.weight_sources import WeightSource, resolve_weights
from slime.checkpoints import layout as ckpt
from slime.checkpoints.layout import CheckpointError
from slime.grpo.config import GRPOConfig
from tests.helpers import geo3k_cfg, make_backend, make_megatron, spawn

KL = GRPOConfig(use_kl_loss=True, kl_loss_coef=0.1)


def _hf_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def _checkpoint_root(path: Path, *rollout_ids: int) -> Path:
    for rollout_id in rollout_ids:
        ckpt.model_dir(path, rollout_id).mkdir(parents=True)
    ckpt.mark_latest(path, rollout_ids[0])
    return path


def _resolve(tmp_path, need_reference=False, **flags):
    hf = tmp_path / "hf"
    if not hf.exists():
        _hf_folder(hf)
    return resolve_weights(CheckpointConfig(hf_checkpoint=str(hf), **flags), need_reference=need_reference)


# ---------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------


def test_load_resumes_a_checkpoint_starts_from_a_hugging_face_folder_or_falls_back(tmp_path):
    hf = _hf_folder(tmp_path / "hf")
    root = _checkpoint_root(tmp_path / "run", 3, 7)  # the marker names 3: the latest complete one
    other = _hf_folder(tmp_path / "other")
    empty = tmp_path / "empty"
    empty.mkdir()

    start = _resolve(tmp_path)
    assert start.policy == WeightSource("--hf-checkpoint", hf) and start.next_rollout_id == 0 and not start.note
    start = _resolve(tmp_path, load=str(root))
    assert start.policy == WeightSource("--load", root, 3) and start.next_rollout_id == 4
    start = _resolve(tmp_path, load=str(other))
    assert start.policy == WeightSource("--load", other) and start.next_rollout_id == 0
    start = _resolve(tmp_path, load=str(tmp_path / "missing"))
    assert start.policy == WeightSource("--hf-checkpoint", hf) and start.next_rollout_id == 0
    assert start.note == f"--load {tmp_path / 'missing'} does not exist"
    start = _resolve(tmp_path, load=str(empty))
    assert start.policy.flag == "--hf-checkpoint" and start.note == f"--load {empty} holds no checkpoint yet"
    assert start.reference is None  # no KL term: --ref-load is not read


def test_ref_load_is_a_checkpoint_root_or_a_hugging_face_folder_else_the_hf_checkpoint(tmp_path):
    hf = _hf_folder(tmp_path / "hf")
    root = _checkpoint_root(tmp_path / "run", 3, 7)
    other = _hf_folder(tmp_path / "other")
    assert _resolve(tmp_path, need_reference=True).reference == WeightSource("--hf-checkpoint", hf)
    assert _resolve(tmp_path, True, ref_load=str(other)).reference == WeightSource("--ref-load", other)
    assert _resolve(tmp_path, True, ref_load=str(root)).reference == WeightSource("--ref-load", root, 3)
    from slime.backends.fsdp.backend import _hf_folder as fsdp_folder  # the FSDP backend reads model/

    assert fsdp_folder(WeightSource("--ref-load", root, 3)) == root / "iter_0000003" / "model"
    assert fsdp_folder(WeightSource("--ref-load", other)) == other
    # --load does not change the reference: it stays the same across a resume
    assert _resolve(tmp_path, True, load=str(other)).reference == WeightSource("--hf-checkpoint", hf)
    with pytest.raises(CheckpointError, match="--ref-load .*missing: no such folder"):
        _resolve(tmp_path, True, ref_load=str(tmp_path / "missing"))
    assert _resolve(tmp_path, False, ref_load=str(tmp_path / "missing")).reference is None


def test_each_bad_folder_is_refused_naming_its_flag(tmp_path):
    _hf_folder(tmp_path / "hf")
    not_hf = tmp_path / "not_hf"
    not_hf.mkdir()
    with pytest.raises(CheckpointError, match="--hf-checkpoint .*not_hf: config.json is missing"):
        resolve_weights(CheckpointConfig(hf_checkpoint=str(not_hf)), need_reference=False)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="--load .*no_weights: no weights"):
        _resolve(tmp_path, load=str(no_weights))
    with pytest.raises(CheckpointError, match="--ref-load .*not_hf: config.json is missing"):
        _resolve(tmp_path, True, ref_load=str(not_hf))
    a_file = tmp_path / "ckpt.pt"  # was: read as a folder holding no checkpoint, a silent fresh start
    a_file.write_bytes(b"not a folder")
    with pytest.raises(CheckpointError, match=rf"--load {a_file} is a file, not a folder"):
        _resolve(tmp_path, load=str(a_file))
    root = _checkpoint_root(tmp_path / "run", 2)
    with pytest.raises(CheckpointError, match=r"--load .*run: the latest checkpoint \(rollout 2\) lacks .*trainer"):
        resolve_weights(CheckpointConfig(hf_checkpoint=str(tmp_path / "hf"), load=str(root)), need_reference=False,
                        backend_parts=("model", "trainer"))


def test_the_driver_logs_where_the_run_really_starts(tmp_path, tiny_ckpt, caplog):
    from slime.driver import prepare

    flags = ("--num-rollout", "1", "--rollout-backend", "transformers", "--train-backend", "fsdp",
             "--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}')
    cases = [
        ((), logging.INFO, f"the policy starts from --hf-checkpoint {tiny_ckpt} (a Hugging Face folder)"),
        (("--load", str(tiny_ckpt)), logging.INFO,
         f"the policy starts from --load {tiny_ckpt} (a Hugging Face folder)"),
        (("--load", str(tmp_path / "typo")), logging.WARNING,
         f"the policy starts from --hf-checkpoint {tiny_ckpt} (a Hugging Face folder) (--load {tmp_path / 'typo'} "
         "does not exist)"),
        (("--use-kl-loss", "--kl-loss-coef", "0.1"), logging.INFO,
         f"; the reference model is --hf-checkpoint {tiny_ckpt} (a Hugging Face folder)"),
    ]  # fmt: skip
    for extra, level, line in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="slime"):
            prepare(geo3k_cfg(tiny_ckpt, *flags, *extra))
        found = [r for r in caplog.records if "the policy" in r.getMessage()]
        assert len(found) == 1 and line in found[0].getMessage() and found[0].levelno == level, found


# ---------------------------------------------------------------------------------------
# both backends follow it (2 ranks each)
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tiny_ckpt, tmp_path_factory):
    """A copy of the tiny checkpoint with every tensor perturbed, and a slime checkpoint root whose latest
    checkpoint's ``model/`` is that copy; returns (the copy, the root, its tensors, the original tensors)."""
    base = tmp_path_factory.mktemp("sources")
    other = base / "other"
    shutil.copytree(tiny_ckpt, other)
    original = load_file(tiny_ckpt / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    perturbed = {n: t + (0.01 * torch.randn(t.shape, generator=generator)).to(t.dtype) for n, t in original.items()}
    save_file(perturbed, other / "model.safetensors", metadata={"format": "pt"})
    root = base / "run"
    shutil.copytree(other, ckpt.model_dir(root, 2))
    ckpt.mark_latest(root, 2)
    return other, root, perturbed, original


def _policy(backend) -> dict[str, torch.Tensor]:
    """This rank's share of the policy's weights by checkpoint name (one round: rank 0 holds them all)."""
    return {n: t.clone() for bucket in backend.iter_weight_buckets(1 << 30, "cpu") for n, t in bucket}


def _job_fsdp(rank_info, ckpt_dir, other, root, out):
    from slime.backends.fsdp.hf_io import iter_hf_weight_groups

    def reference(backend):
        return {n: t.clone() for group in iter_hf_weight_groups(backend.ref_model, torch.float32) for n, t in group}

    found = {}
    for name, load in (("load_hf", other), ("load_missing", out / "missing")):
        backend = make_backend(rank_info, ckpt_dir, checkpoint={"load": str(load)})
        found[name] = (backend.init(), _policy(backend))
    for name, ref_load in (("ref_hf", other), ("ref_checkpoint", root), ("ref_default", None)):
        backend = make_backend(rank_info, ckpt_dir, grpo=KL, checkpoint={"ref_load": ref_load and str(ref_load)})
        backend.init()
        found[name] = reference(backend)
    torch.save(found, out / f"fsdp{rank_info.rank}.pt")


def _merged(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    out = {}
    for found in ranks:
        value = found[name]
        out.update(value[1] if isinstance(value, tuple) else value)
    return out


def _assert_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(got[name].dtype)), (what, name)


def test_fsdp_follows_the_rule(folders, tiny_ckpt, tmp_path):
    other, root, perturbed, original = folders
    spawn(_job_fsdp, tiny_ckpt, other, root, tmp_path)
    ranks = [torch.load(tmp_path / f"fsdp{r}.pt") for r in range(2)]
    assert ranks[0]["load_hf"][0] == ranks[0]["load_missing"][0] == 0  # both fresh runs
    _assert_weights(_merged(ranks, "load_hf"), perturbed, "--load <hf folder>")
    _assert_weights(_merged(ranks, "load_missing"), original, "--load <missing>")
    _assert_weights(_merged(ranks, "ref_hf"), perturbed, "--ref-load <hf folder>")
    _assert_weights(_merged(ranks, "ref_checkpoint"), perturbed, "--ref-load <checkpoint root>")
    _assert_weights(_merged(ranks, "ref_default"), original, "no --ref-load")


def _job_megatron(rank_info, ckpt_dir, other, out):
    from slime.backends.megatron.weight_export import iter_buckets

    backend = make_megatron(rank_info, ckpt_dir, checkpoint={"load": str(out / "missing")})
    found = {"load_missing": (backend.init(), _policy(backend))}
    backend = make_megatron(rank_info, ckpt_dir, grpo=KL, checkpoint={"ref_load": str(other)})
    backend.init()
    found["ref_hf"] = {n: t.clone() for bucket in iter_buckets(backend.ref_model, 1 << 30, device="cpu")
                       for n, t in bucket}
    torch.save(found, out / f"megatron{rank_info.rank}.pt")


def test_megatron_follows_the_rule(folders, tiny_ckpt, tmp_path):
    """Its --load of a Hugging Face folder and of a checkpoint, and --ref-load of a checkpoint, are in
    tests/test_megatron_backend.py (save_resume)."""
    pytest.importorskip("megatron.core")

    other, _, perturbed, original = folders
    spawn(_job_megatron, tiny_ckpt, other, tmp_path)
    ranks = [torch.load(tmp_path / f"megatron{r}.pt") for r in range(2)]
    assert ranks[0]["load_missing"][0] == 0
    _assert_weights(_merged(ranks, "load_missing"), original, "--load <missing>")
    _assert_weights(_merged(ranks, "ref_hf"), perturbed, "--ref-load <hf folder>")
