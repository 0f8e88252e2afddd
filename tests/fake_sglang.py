"""The SGLang engine with the fake server of :mod:`tests.fake_sglang_server` in place of SGLang.

:class:`FakeSGLangEngine` is :class:`slime.rollout.engines.sglang.engine.SGLangEngine` unchanged except for
two things: it accepts CPU bundles, and its server command runs ``tests/fake_sglang_server.py`` with the very
flags the real command would give SGLang (``--sglang-fake-*`` flags pass through to the fake like any other
SGLang flag).  Select it with ``--rollout-backend tests.fake_sglang:FakeSGLangEngine``.
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
