"""Rollout engines for the engine-group and shutdown tests, selected like any user engine with
``--rollout-backend tests.stub_engines:<Class>`` (the registry's ``module:Class`` path).

:class:`EchoEngine` runs no model: each output's text is a JSON record of what the engine was
given and who served the request, so tests can check the engine's resources, its thread count,
the request order and which engine served each request.  The subclasses add one behaviour each
(slow, never healthy, failing constructor, a server that dies).  :class:`ServerEngine` is the real transformers
engine plus a "server" process that, like a daemonised server, is not a child of the engine's
actor, so only the engine's own ``shutdown()`` stops it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from slime.rollout.engines.base import (
    EngineResources,
    EngineUnavailableError,
    GenerateOutput,
    GenerateRequest,
    RolloutEngine,
)
from slime.rollout.engines.hf_engine import TransformersEngine


class EchoEngine(RolloutEngine):
    """Answers every request at once with ``{"engine", "call", "rid", "threads", "bundles", "node_ips", "cpus"}``
    (``call``: 1 for the engine's first generate call, 2 for its second, ...); ``prompt_tokens`` is the
    length of the request text in characters."""

    CAPACITY = 2
    """Requests per generate call."""

    def __init__(self, resources: EngineResources):
        self.resources = resources
        self.paused = False
        self.calls = 0

    @classmethod
    def from_spec(cls, spec, resources: EngineResources) -> EchoEngine:
        return cls(resources)

    @property
    def capacity(self) -> int:
        return self.CAPACITY

    def delay(self) -> None:
        """Time each generate call takes; none here."""

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        if self.paused:
            raise RuntimeError("generation is paused")
        if len(requests) > self.capacity:
            raise RuntimeError(f"got {len(requests)} requests, more than the capacity {self.capacity}")
        self.calls += 1
        self.delay()
        record = {
            "engine": self.resources.index,
            "call": self.calls,
            "threads": torch.get_num_threads(),
            "bundles": self.resources.bundle_indices,
            "node_ips": self.resources.node_ips,
            "cpus": self.resources.num_cpus,
        }
        return [
            GenerateOutput(json.dumps({**record, "rid": r.rid}), [1], [0.0], "stop", prompt_tokens=len(r.text))
            for r in requests
        ]

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True) -> None:
        pass

    def release_memory_occupation(self, tags=None) -> None:
        pass

    def resume_memory_occupation(self, tags=None) -> None:
        pass

    def pause_generation(self) -> None:
        self.paused = True

    def continue_generation(self) -> None:
        self.paused = False


class SlowSecondEngine(EchoEngine):
    """Engine 1 takes :attr:`SLOW_S` seconds per generate call; the others answer at once."""

    SLOW_S = 1.0

    def delay(self) -> None:
        if self.resources.index == 1:
            time.sleep(self.SLOW_S)


class ConcurrentEchoEngine(EchoEngine):
    """Like a continuous-batching server: 4 requests in flight, one per call, 4 calls at once, each
    taking :attr:`CALL_S` seconds; outputs also carry ``"overlap"``, the most calls seen running at once."""

    CAPACITY = 4
    CALL_S = 1.0
    max_concurrent_calls = 4

    def __init__(self, resources: EngineResources):
        super().__init__(resources)
        self.lock = threading.Lock()
        self.running = self.overlap = 0

    @property
    def max_requests_per_call(self) -> int:
        return 1

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        with self.lock:
            self.running += 1
            self.overlap = max(self.overlap, self.running)
        try:
            if len(requests) > self.max_requests_per_call:
                raise RuntimeError(f"got {len(requests)} requests in one call, more than 1")
            time.sleep(self.CALL_S)
            outputs = super().generate(requests)
            with self.lock:
                for out in outputs:
                    out.text = json.dumps({**json.loads(out.text), "overlap": self.overlap})
            return outputs
        finally:
            with self.lock:
                self.running -= 1


class AbortableEchoEngine(ConcurrentEchoEngine):
    """Request ``r0`` is answered at once; every other call waits (up to 60 s) until :meth:`abort_requests`,
    then returns ``finish_reason "abort"``."""

    def __init__(self, resources: EngineResources):
        super().__init__(resources)
        self.aborted = threading.Event()

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        if requests[0].rid == "r0":
            return EchoEngine.generate(self, requests)
        reason = "abort" if self.aborted.wait(60) else "stop"
        return [GenerateOutput(r.rid, [1], [0.0], reason, prompt_tokens=len(r.text)) for r in requests]

    def abort_requests(self) -> None:
        self.aborted.set()


class NeverHealthyEngine(EchoEngine):
    """Engine 1's ``health()`` is always False, and its log says why."""

    def health(self) -> bool:
        return self.resources.index != 1

    def log_tail(self) -> str:
        return "server: still loading shard 3 of 7" if self.resources.index == 1 else ""


class FailingEngine(EchoEngine):
    """Engine 1's constructor raises."""

    def __init__(self, resources: EngineResources):
        if resources.index == 1:
            raise OSError("no server binary at /opt/server (stub)")
        super().__init__(resources)


class CrashingEngine(EchoEngine):
    """Engine 0's "server" dies on its second generate call (:class:`EngineUnavailableError`, nothing
    served); ``restart()`` brings up a new one that serves.  Outputs also carry ``"life"`` (restarts so
    far) and ``"weights"``: the ``"version"`` tensor last pushed with ``update_weights_from_tensor``, 0 at
    start-up and after a restart (the start-up weights)."""

    def __init__(self, resources: EngineResources):
        super().__init__(resources)
        self.life = self.weights = 0

    def crashes(self) -> bool:
        return self.resources.index == 0 and self.life == 0 and self.calls == 1

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        if self.crashes():
            raise EngineUnavailableError(f"server of engine {self.resources.index} died (stub)")
        outputs = super().generate(requests)
        for out in outputs:
            out.text = json.dumps({**json.loads(out.text), "life": self.life, "weights": self.weights})
        return outputs

    def restart(self) -> None:
        self.life += 1
        self.calls = self.weights = 0

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True) -> None:
        self.weights = int(dict(named_tensors)["version"])


class CrashingWithASurvivorEngine(CrashingEngine):
    """:class:`CrashingEngine` with engine 1 answering no call before engine 0 has crashed (``<--output-dir>/
    engine-0-crashed`` exists), so engine 0 gets its second call however slow its first one is; without this, a
    loaded machine can let engine 1 serve the whole step before engine 0's first call returns."""

    WAIT_S = 300.0
    """How long engine 1 waits for engine 0's crash before it raises."""

    @classmethod
    def from_spec(cls, spec, resources: EngineResources) -> CrashingWithASurvivorEngine:
        engine = cls(resources)
        engine.crashed = Path(spec.output_dir, "engine-0-crashed")
        return engine

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        if self.crashes():
            self.crashed.parent.mkdir(parents=True, exist_ok=True)
            self.crashed.touch()
        elif self.resources.index == 1:
            deadline = time.monotonic() + self.WAIT_S
            while not self.crashed.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine 0 did not crash within {self.WAIT_S:g} s (stub)")
                time.sleep(0.01)
        return super().generate(requests)


class AlwaysCrashingEngine(CrashingEngine):
    """Every generate call raises :class:`EngineUnavailableError`, also after each restart."""

    def crashes(self) -> bool:
        return True


class LeakyEngine(EchoEngine):
    """Starts a child process and never stops it; its outputs carry ``"child_pid"``."""

    def __init__(self, resources: EngineResources):
        super().__init__(resources)
        self.child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        outputs = super().generate(requests)
        for out in outputs:
            out.text = json.dumps({**json.loads(out.text), "child_pid": self.child.pid})
        return outputs


class ServerEngine(TransformersEngine):
    """The transformers engine plus a long-running "server" process in a session of its own.

    A launcher (the actor's child) starts the server and stays; the server is the launcher's
    child in the launcher's new session, so it outlives both the actor and the launcher unless
    ``shutdown()`` stops that session.  ``<--output-dir>/engine-<index>.json`` records the
    pids of the actor and the server.
    """

    @classmethod
    def from_spec(cls, spec, resources: EngineResources) -> ServerEngine:
        engine = super().from_spec(spec, resources)
        server = "import time\nwhile True: time.sleep(1)"
        launcher = (
            "import subprocess, sys, time\n"
            f"server = subprocess.Popen([sys.executable, '-c', {server!r}])\n"
            "print(server.pid, flush=True)\n"
            "server.wait()\n"
        )
        engine.launcher = subprocess.Popen(
            [sys.executable, "-c", launcher], start_new_session=True, stdout=subprocess.PIPE, text=True
        )
        server_pid = int(engine.launcher.stdout.readline())
        record = {"actor_pid": os.getpid(), "launcher_pid": engine.launcher.pid, "server_pid": server_pid}
        Path(spec.output_dir, f"engine-{resources.index}.json").write_text(json.dumps(record))
        return engine

    def shutdown(self) -> None:
        try:
            os.killpg(self.launcher.pid, signal.SIGKILL)  # the launcher's session: launcher and server
        except ProcessLookupError:
            pass
        self.launcher.wait()
        super().shutdown()
