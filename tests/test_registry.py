"""One registry mechanism for engines, backends and weight-sync transports.

Built-ins are declared by import path and imported on the first lookup; importing a registry
imports none of them; a built-in that is planned (the Megatron backend, the SGLang engine) or
whose packages are missing stops at parse time, naming each package and whether it is installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from slime.backends.registry import TRAIN_BACKENDS
from slime.rollout.engines import ENGINES
from slime.utils.arguments import parse_args
from slime.utils.registry import Builtin, Registry, Unavailable

ROOT = Path(__file__).resolve().parents[1]
BASE = (
    "--hf-checkpoint not-on-disk/ckpt --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
    "--rollout-max-response-len 64 --colocate"
).split()


def _status(dist: str) -> str:
    try:
        return f"installed: {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_planned_backend_and_missing_engine_stop_at_parse_time_naming_their_packages(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(BASE)  # upstream's defaults: --train-backend megatron --rollout-backend sglang
    assert info.value.code == 2
    err = capsys.readouterr().err
    if _status("sglang") == "not installed":  # built, but its package is missing here
        assert "--rollout-backend sglang cannot run here: it needs sglang 0.5.17 (not installed)" in err
    assert "--train-backend megatron is not in this version yet" in err
    for dist, pin in (("megatron-core", "0.16.1"), ("flash-linear-attention", "0.6.0"), ("sglang", "0.5.17")):
        assert f"{dist} {pin} ({_status(dist)})" in err
    assert "use --train-backend fsdp meanwhile" in err


def test_the_built_backend_and_engine_parse_and_resolve():
    from slime.backends.fsdp.backend import FSDPBackend
    from slime.rollout.engines.hf_engine import TransformersEngine

    cfg = parse_args(BASE + ["--train-backend", "fsdp", "--rollout-backend", "transformers"])
    assert TRAIN_BACKENDS.get(cfg.train.train_backend) is FSDPBackend
    assert ENGINES.get(cfg.rollout.rollout_backend) is TransformersEngine


def test_declared_packages_are_the_pyproject_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert TRAIN_BACKENDS.builtins["megatron"].requires == tuple(extras["megatron"])
    assert ENGINES.builtins["sglang"].requires == tuple(extras["sglang"])


def test_builtin_is_imported_on_first_lookup_and_refuses_a_duplicate():
    registry = Registry("codec", "--codec", builtins={"json": Builtin(target="json:dumps")})
    assert registry.names() == ["json"] and "json" in registry
    assert registry.get("json") is json.dumps
    assert registry.problem("json") is None
    with pytest.raises(KeyError, match="already registered"):
        registry.register("json")(json.loads)
    with pytest.raises(KeyError, match="valid: json"):
        registry.get("yaml")


def test_missing_package_is_named_with_what_is_installed():
    registry = Registry(
        "codec", "--codec", builtins={"fast": Builtin(target="json:dumps", requires=("no-such-dist-xyz==1.0", "torch"))}
    )
    problem = registry.problem("fast")
    assert problem == (
        f"--codec fast cannot run here: it needs no-such-dist-xyz 1.0 (not installed), "
        f"torch (installed: {torch.__version__})"
    )
    with pytest.raises(Unavailable, match="no-such-dist-xyz 1.0 \\(not installed\\)"):
        registry.get("fast")


def test_import_paths_are_checked_without_importing():
    registry = Registry("codec", "--codec")
    assert registry.problem("json:dumps") is None
    assert "no module named 'no_such_module_xyz'" in registry.problem("no_such_module_xyz:f")
    assert "cannot be imported here" in registry.problem("no_such_pkg_xyz.mod:f")


def test_importing_the_registries_imports_no_implementation():
    code = (
        "import sys\n"
        "import slime.utils.arguments, slime.backends.registry, slime.rollout.engines, slime.weight_sync\n"
        "heavy = [m for m in ('megatron', 'sglang', 'slime.backends.fsdp.backend', 'slime.backends.fsdp.hf_io',\n"
        "         'slime.rollout.engines.hf_engine', 'slime.weight_sync.object_store', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
