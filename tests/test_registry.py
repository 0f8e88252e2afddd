"""One registry mechanism for engines, backends and weight-sync transports.

Built-ins are declared by import path and imported on the first lookup; importing a registry
imports none of them; a built-in that is planned (the SGLang engine) or whose packages are missing
stops at parse time, naming each package and whether it is installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from slime.arguments import parse_args
from slime.backends.registry import TRAIN_BACKENDS
from slime.rollout.engines import ENGINES
from slime.utils.config import ConfigError
from slime.utils.registry import Builtin, Registry, Unavailable

ROOT = Path(__file__).resolve().parents[1]
BASE = (
    "--hf-checkpoint not-on-disk/ckpt --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
    "--rollout-max-response-len 64 --colocate"
).split()


def _status(dist: str, pin: str) -> str:
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    return f"installed: {version}" if version.split("+")[0] == pin else f"installed {version}, needs =={pin}"


def test_planned_backend_and_missing_engine_stop_at_parse_time_naming_their_packages(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(BASE)  # upstream's defaults: --train-backend megatron --rollout-backend sglang
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--train-backend megatron" not in err  # built: megatron-core is in the CPU profile too
    if _status("sglang", "0.5.17") != "installed: 0.5.17":  # built, but its package is missing here
        assert f"--rollout-backend sglang cannot run here: it needs sglang 0.5.17 ({_status('sglang', '0.5.17')})" in err
        # ... and the way out: the GPU profile that installs it, or the engine that runs here
        assert "installed by the GPU profile (bash scripts/setup_env.sh" in err
        assert "here use --rollout-backend transformers" in err


def test_the_built_backend_and_engine_parse_and_resolve():
    from slime.backends.fsdp.backend import FSDPBackend
    from slime.backends.megatron.backend import MegatronBackend
    from slime.rollout.engines.hf_engine import TransformersEngine

    cfg = parse_args(BASE + ["--train-backend", "fsdp", "--rollout-backend", "transformers"])
    assert TRAIN_BACKENDS.get(cfg.train.train_backend) is FSDPBackend
    assert ENGINES.get(cfg.rollout.rollout_backend) is TransformersEngine
    cfg = parse_args(BASE + ["--rollout-backend", "transformers"])  # upstream's default trainer
    assert TRAIN_BACKENDS.get(cfg.train.train_backend) is MegatronBackend


def test_declared_packages_are_the_pyproject_extras():
    from slime.backends.megatron.model import GPU_KERNEL_PACKAGES

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # megatron-core runs the backend; the extra's other packages are the bf16 GPU kernels, checked where picked
    assert TRAIN_BACKENDS.builtins["megatron"].requires + GPU_KERNEL_PACKAGES == tuple(extras["megatron"])
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


def test_a_missing_package_message_ends_with_the_entrys_way_out():
    registry = Registry("codec", "--codec", builtins={
        "fast": Builtin(target="json:dumps", requires=("no-such-dist-xyz==1.0",), fix="use --codec json"),
        "json": Builtin(target="json:dumps", fix="never shown: nothing is missing"),
    })  # fmt: skip
    assert registry.problem("fast") == "--codec fast cannot run here: it needs no-such-dist-xyz 1.0 (not installed); use --codec json"
    assert registry.problem("json") is None
    with pytest.raises(ConfigError, match="; use --codec json$"):
        registry.resolve("fast")


def test_a_pinned_package_at_another_version_is_refused():
    """Presence is not enough: the pin is compared with the installed version (without its local label)."""
    torch_public = torch.__version__.split("+")[0]
    major, minor, *_ = torch_public.split(".")
    other = f"{major}.{int(minor) + 1}.0"
    registry = Registry("codec", "--codec", builtins={
        "same": Builtin(target="json:dumps", requires=(f"torch=={torch_public}",)),  # 2.13.0 meets 2.13.0+cpu
        "newer": Builtin(target="json:dumps", requires=(f"torch=={other}",)),
    })  # fmt: skip
    assert registry.problem("same") is None and registry.get("same") is json.dumps
    assert registry.problem("newer") == (
        f"--codec newer cannot run here: it needs torch {other} (installed {torch.__version__}, needs =={other})"
    )
    with pytest.raises(Unavailable, match=f"needs =={other}"):
        registry.get("newer")


def test_import_paths_are_checked_without_importing():
    registry = Registry("codec", "--codec")
    assert registry.problem("json:dumps") is None
    assert "no module named 'no_such_module_xyz'" in registry.problem("no_such_module_xyz:f")
    assert "cannot be imported here" in registry.problem("no_such_pkg_xyz.mod:f")
    assert "'json.decoder' is not a package" in registry.problem("json.decoder.x:f")


def test_finding_a_module_runs_no_package_code(tmp_path):
    """A module two packages deep is found with neither package's __init__ (nor the module) run; for a
    missing one the import system has the last word, which imports the parents: their failure is
    reported, not raised."""
    from slime.utils.registry import find_module_problem

    pkg = tmp_path / "probe_pkg_xyz" / "sub"
    pkg.mkdir(parents=True)
    for folder in (pkg.parent, pkg):
        (folder / "__init__.py").write_text("raise RuntimeError('package code ran')\n")
    (pkg / "mod.py").write_text("raise RuntimeError('module code ran')\n")
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from slime.utils.registry import find_module_problem\n"
        "assert find_module_problem('probe_pkg_xyz.sub.mod') is None\n"
        "assert find_module_problem('probe_pkg_xyz.sub') is None\n"
        "assert not [m for m in sys.modules if m.startswith('probe_pkg_xyz')]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
    # a typo in the last part: find_spec imports the parents, whose __init__ raises here
    sys.path.insert(0, str(tmp_path))
    try:
        why = find_module_problem("probe_pkg_xyz.sub.nope")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("probe_pkg_xyz")]:
            del sys.modules[name]
    assert why == "importing its parent packages raised RuntimeError: package code ran"


def test_find_module_problem_finds_modules_in_nested_namespace_packages(tmp_path):
    """Folders without ``__init__.py`` (the repository's ``scripts/harness``, a user's plug-in tree): the path of a
    nested namespace package needs its parent imported, and looking the module up raised ``KeyError`` at parse time
    (``--custom-rm-path scripts.harness.colour_task:colour_reward`` in a fresh interpreter).  In a fresh interpreter,
    so that no earlier import of the parents hides it."""
    (tmp_path / "probe_ns_xyz" / "sub").mkdir(parents=True)
    (tmp_path / "probe_ns_xyz" / "sub" / "mod.py").write_text("X = 1\n")
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from slime.utils.registry import find_module_problem\n"
        "assert find_module_problem('probe_ns_xyz.sub.mod') is None\n"
        "print(find_module_problem('probe_ns_xyz.sub.nope'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.strip() == "no module named 'probe_ns_xyz.sub.nope'"


def test_resolve_names_the_flag_for_every_failure():
    from slime.utils.config import ConfigError

    registry = Registry("codec", "--codec", builtins={"planned": Builtin(target=None, planned="next release")})
    assert registry.resolve("json:dumps") is json.dumps
    cases = {
        "planned": "--codec planned is not in this version yet (next release)",
        "json:no_such_attr": "--codec json:no_such_attr: cannot be imported here: AttributeError: 'json' has no attribute",
        "nope_xyz.mod:fn": "--codec nope_xyz.mod:fn: cannot be imported here: ModuleNotFoundError: No module named 'nope_xyz'",
        "yaml": "--codec yaml: not available in this installation (unknown codec 'yaml' for --codec; valid: planned",
    }
    for name, message in cases.items():
        with pytest.raises(ConfigError) as info:
            registry.resolve(name)
        assert str(info.value).startswith(message), (name, str(info.value))
    with pytest.raises(ConfigError, match="^--custom-flag nope_xyz:fn: cannot be imported"):
        registry.resolve("nope_xyz:fn", flag="--custom-flag")


def test_a_user_module_not_on_the_path_gets_a_path_hint_a_missing_attribute_does_not(monkeypatch, tmp_path):
    from slime.utils.config import ConfigError

    monkeypatch.chdir(tmp_path)
    registry = Registry("codec", "--codec")
    hint = f"Python looks for 'nope_xyz' in the working directory ({tmp_path}) and on PYTHONPATH"
    assert hint in registry.problem("nope_xyz.mod:fn")  # parse time, nothing imported
    with pytest.raises(ConfigError, match=re.escape(hint)):
        registry.resolve("nope_xyz.mod:fn")
    with pytest.raises(ConfigError) as info:
        registry.resolve("json:no_such_attr")
    assert "PYTHONPATH" not in str(info.value)


def test_importing_the_registries_imports_no_implementation():
    code = (
        "import sys\n"
        "import slime.arguments, slime.backends.registry, slime.rollout.engines, slime.weight_sync\n"
        "heavy = [m for m in ('megatron', 'sglang', 'slime.backends.fsdp.backend', 'slime.backends.fsdp.hf_io',\n"
        "         'slime.rollout.engines.hf_engine', 'slime.weight_sync.object_store', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
