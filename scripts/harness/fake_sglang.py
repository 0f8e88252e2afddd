"""The SGLang engine with the fake server of :mod:`scripts.harness.fake_sglang_server` in place of SGLang.

:class:`FakeSGLangEngine` is :class:`slime.rollout.engines.sglang.engine.SGLangEngine` unchanged except for
two things: it accepts CPU bundles, and its server command runs ``scripts/harness/fake_sglang_server.py`` with the very
flags the real command would give SGLang (``--sglang-fake-*`` flags pass through to the fake like any other
SGLang flag).  Select it with ``--rollout-backend scripts.harness.fake_sglang:FakeSGLangEngine``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from slime.rollout.engines.base import EngineResources
from slime.rollout.engines.sglang.engine import SGLangEngine
from slime.rollout.engines.sglang.launch import SERVER_MODULE, server_command

FAKE_SERVER = str(Path(__file__).with_name("fake_sglang_server.py"))


class FakeSGLangEngine(SGLangEngine):
    @classmethod
    def check_resources(cls, resources: EngineResources) -> None:
        """CPU bundles are fine: the fake server needs no GPU."""

    def server_command(self) -> list[str]:
        command = server_command(self.spec)
        assert command[1:3] == ["-m", SERVER_MODULE], command
        return [sys.executable, FAKE_SERVER, *command[3:]]


class SharedGpuFakeSGLangEngine(FakeSGLangEngine):
    """:class:`FakeSGLangEngine` as if every engine of the run were on one GPU (``"fake0"``): their server starts
    take the same :class:`~slime.rollout.engines.sglang.launch.GPUStartLock`, as two real engines on one GPU do."""

    def __init__(self, spec, run_dir, **kwargs):
        kwargs["gpu_ids"] = ["fake0"]
        super().__init__(spec, run_dir, **kwargs)


DATA = Path(__file__).resolve().parents[2] / "examples" / "geo3k_vlm" / "data"


def start_engine_group(work_dir: Path, *sglang_flags: str, num_engines: int = 2, capacity: int = 4,
                       engine: str = "scripts.harness.fake_sglang:FakeSGLangEngine", timeout_s: float = 300.0):
    """``num_engines`` fake SGLang engines (one CPU bundle each) in the real engine group, healthy.

    Needs Ray started (:func:`slime.ray.placement.init_ray`).  ``sglang_flags`` pass through as
    ``--sglang-*`` flags (``--sglang-fake-delay-s 2`` and the like); ``capacity`` is
    ``--sglang-server-concurrency``.  Returns ``(placement, engines)``; the caller shuts the engines down and
    removes the placement (done here when start-up fails).
    """
    from slime.arguments import parse_args
    from scripts.harness.engine_group import start_engines

    cfg = parse_args([
        "--hf-checkpoint", str(work_dir), "--prompt-data", str(DATA), "--num-rollout", "1",
        "--rollout-batch-size", "2", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
        "--rollout-backend", engine, "--rollout-num-gpus", str(num_engines),
        "--output-dir", str(work_dir / "run"), "--sglang-server-concurrency", str(capacity), *sglang_flags,
    ])  # fmt: skip
    return start_engines(cfg, timeout_s)
