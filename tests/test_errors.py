"""One error base class (slime.errors.SlimeError): every user-facing error of slime derives from it, and
``python -m slime.train`` turns one into ``slime: error: <message>`` and exit status 2 before the first step."""

from __future__ import annotations

import importlib

import pytest

from slime.errors import SlimeError

USER_FACING = [
    # (module, class, the standard type callers already catch it as)
    ("slime.utils.config", "ConfigError", ValueError),
    ("slime.checkpoints.layout", "CheckpointError", RuntimeError),
    ("slime.checkpoints.hf", "HFFolderError", FileNotFoundError),
    ("slime.data.sources", "DatasetError", ValueError),
    ("slime.data.image", "ImageDecodeError", ValueError),
    ("slime.data.processor", "ImageSizeError", ValueError),
    ("slime.ray.placement", "PlacementError", RuntimeError),
    ("slime.ray.placement", "RayAddressError", ConnectionError),
    ("slime.ray.engine_group", "EngineStartError", RuntimeError),
    ("slime.rollout.manager", "PromptMismatchError", RuntimeError),
    ("slime.rollout.manager", "RolloutAbortedError", RuntimeError),
    ("slime.rollout.manager", "NonFiniteRewardError", RuntimeError),
    ("slime.rollout.parity", "EngineParityError", RuntimeError),
    ("slime.utils.run_lock", "RunDirError", ValueError),
    ("slime.models.qwen3_5.config", "Qwen35ConfigError", ValueError),
    ("slime.backends.megatron.model", "KernelUnavailable", RuntimeError),
]


@pytest.mark.parametrize("module, name, standard", USER_FACING, ids=[name for _, name, _ in USER_FACING])
def test_user_facing_errors_derive_from_slime_error_and_keep_their_standard_type(module, name, standard):
    if module == "slime.backends.megatron.model":
        pytest.importorskip("megatron.core")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, SlimeError) and issubclass(cls, standard)
    error = cls("--flag 3: the message")
    assert str(error) == "--flag 3: the message"


@pytest.mark.parametrize(
    "module, name",
    [("slime.checkpoints.layout", "CheckpointError"), ("slime.ray.placement", "RayAddressError"),
     ("slime.ray.engine_group", "EngineStartError"), ("slime.utils.run_lock", "RunDirError")],
)  # fmt: skip
def test_main_turns_a_slime_error_into_exit_status_2_with_its_message(module, name, tmp_path, monkeypatch, capsys):
    from slime import driver
    from slime.train import EXIT_NOT_STARTED, main

    cls = getattr(importlib.import_module(module), name)

    def resolve_components(cfg):
        raise cls(f"--hf-checkpoint {tmp_path}: what {name} says")

    monkeypatch.setattr(driver, "resolve_components", resolve_components)
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-rollout", "1", "--rollout-num-gpus", "1",
            "--train-backend", "fsdp", "--rollout-backend", "transformers", "--check-only"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == EXIT_NOT_STARTED == 2
    assert capsys.readouterr().err == f"slime: error: --hf-checkpoint {tmp_path}: what {name} says\n"


def test_main_prints_a_slime_error_raised_in_a_ray_actor_without_rays_traceback(tmp_path, monkeypatch, capsys):
    # ray.get re-raises an actor's error as RayTaskError(<its class>), whose text is Ray's header and the remote
    # traceback: once printed whole after "slime: error:".
    from ray.exceptions import RayTaskError

    from slime import driver
    from slime.train import main
    from slime.utils.config import ConfigError

    def resolve_components(cfg):
        raise RayTaskError("TrainerActor.train", "Traceback (most recent call last):\n  File x\nConfigError: boom",
                           ConfigError("--flag 3: boom")).as_instanceof_cause()

    monkeypatch.setattr(driver, "resolve_components", resolve_components)
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-rollout", "1", "--rollout-num-gpus", "1",
            "--train-backend", "fsdp", "--rollout-backend", "transformers", "--check-only"]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)
    assert capsys.readouterr().err == "slime: error: --flag 3: boom\n"


def test_main_leaves_other_errors_their_traceback(tmp_path, monkeypatch):
    from slime import driver
    from slime.train import main

    def resolve_components(cfg):
        raise KeyError("a bug")

    monkeypatch.setattr(driver, "resolve_components", resolve_components)
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-rollout", "1", "--rollout-num-gpus", "1",
            "--train-backend", "fsdp", "--rollout-backend", "transformers", "--check-only"]  # fmt: skip
    with pytest.raises(KeyError, match="a bug"):
        main(argv)


def test_main_lets_go_of_the_runs_actor_handles_before_it_exits(local_ray, tmp_path, monkeypatch, capsys):
    """A run that stopped on an error: its Ray actor handles, also those in a reference cycle (as an engine group and
    its re-sync hook) and in the frames of the error's traceback, are released before ``main`` exits, not by the
    interpreter's last collection at exit, where ``ActorHandle.__del__`` meets Ray torn down (a traceback at shutdown).
    """
    import gc
    import weakref

    import ray

    from slime import driver
    from slime.train import EXIT_NOT_STARTED, main
    from slime.utils.config import ConfigError

    @ray.remote(num_cpus=0)
    class Probe:
        def ping(self):
            return 1

    handles = []

    def train(cfg, on_start=None):
        group = {"actors": [Probe.remote()]}
        group["self"] = group  # a cycle: only the garbage collector frees it
        assert ray.get(group["actors"][0].ping.remote()) == 1
        handles.append(weakref.ref(group["actors"][0]))
        raise ConfigError("--prompt-data x: the error that ends the run")

    monkeypatch.setattr(driver, "train", train)
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-rollout", "1", "--rollout-num-gpus", "1",
            "--train-backend", "fsdp", "--rollout-backend", "transformers",
            "--output-dir", str(tmp_path / "run")]  # fmt: skip
    gc.disable()  # no collection but main's own
    try:
        with pytest.raises(SystemExit) as info:
            main(argv)
        alive = handles[0]() is not None
    finally:
        gc.enable()
    assert info.value.code == EXIT_NOT_STARTED
    assert info.value.__context__ is None  # the exit does not hold on to the error, its traceback and their frames
    assert not alive, "the run's actor handle outlived main"
    assert capsys.readouterr().err.endswith("slime: error: --prompt-data x: the error that ends the run\n")


@pytest.mark.parametrize("module", ["slime", "slime.train"])
def test_both_entry_points_print_the_flags(module):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: slime --hf-checkpoint DIR") and "--train-backend" in proc.stdout
