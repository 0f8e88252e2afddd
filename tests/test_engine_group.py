"""Rollout engines on a real local Ray (CPU bundles): placement over all of an engine's bundles,
start-up health checks, per-request balancing (also when a step fits in the engines at once),
pause/continue and shutdown.

The engines are the stubs of :mod:`tests.stub_engines`, selected with ``--rollout-backend
tests.stub_engines:<Class>`` and started the way the driver starts them
(``RolloutEngineGroup(placement, partial(engine_cls.from_spec, spec))``).  Expected bundles,
thread counts and schedules are worked out by hand from the flags.  The scheduler's logic without Ray
and without real time: :mod:`tests.test_scheduler`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table

from slime.arguments import parse_args
from slime.ray.engine_group import EngineStartError
from slime.ray.placement import node_ip
from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.scheduler import MAX_ATTEMPTS, EngineError
from tests.process_tree import read_proc, wait_for
from scripts.harness.engine_group import build_engines, start_engines

DATA = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"
START_TIMEOUT_S = 300.0
"""Start-up limit for engines that do start: each is a new Python process importing torch (slow under load)."""


def _cfg(tmp_path, engine: str, *cluster: str):
    return parse_args([
        "--hf-checkpoint", str(tmp_path), "--prompt-data", str(DATA), "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
        "--train-backend", "fsdp",
        "--rollout-backend", f"tests.stub_engines:{engine}", *cluster,
    ])  # fmt: skip


def _start(cfg, timeout_s: float = START_TIMEOUT_S):
    """(placement, engines) as the driver builds them; the caller removes the placement."""
    return start_engines(cfg, timeout_s)


def _requests(n: int) -> list[GenerateRequest]:
    params = SamplingParams(max_new_tokens=1)
    return [GenerateRequest(f"prompt {i}" + "!" * i, [], params, rid=f"r{i}") for i in range(n)]


def _records(outputs) -> list[dict]:
    return [json.loads(out.text) for out in outputs]


def test_engine_spans_both_of_its_cpu_bundles(local_ray, tmp_path, monkeypatch):
    import slime.ray.placement as placement_module

    # 20 cores (as the driver sees them) over 1 trainer bundle + 4 engine bundles: 4 cores per
    # bundle, so an engine of 2 bundles gets 8 torch threads.
    monkeypatch.setattr(placement_module.os, "cpu_count", lambda: 20)
    cfg = _cfg(tmp_path, "EchoEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "4",
               "--rollout-num-gpus-per-engine", "2")
    placement, engines = _start(cfg)
    try:
        assert placement.engine_bundles == [[0, 1], [2, 3]]
        records = _records(engines.generate(_requests(4)))
        by_engine = {r["engine"]: r for r in records}
        assert sorted(by_engine) == [0, 1]
        for index, bundles in [(0, [0, 1]), (1, [2, 3])]:
            assert by_engine[index]["bundles"] == bundles
            assert by_engine[index]["threads"] == 8
            assert by_engine[index]["cpus"] == 2.0
            assert by_engine[index]["node_ips"] == [node_ip()]

        # The engine placement group holds all 4 bundles: none of their CPUs is available outside it,
        # the actors hold each engine's first bundle, and each second bundle stays reserved and unused.
        table = placement_group_table(placement.engine_pg)
        assert table["state"] == "CREATED" and table["bundles"] == {i: {"CPU": 1.0} for i in range(4)}
        pg_id = placement.engine_pg.id.hex()

        def settled():
            free = ray.available_resources()
            return free if free.get(f"CPU_group_0_{pg_id}", 0) == 0 else None

        free = wait_for(settled, timeout_s=30, what="Ray's resource view to show the engine actors")
        assert free.get("CPU") == 6 - 5  # 5 bundles of this run reserved
        assert [free.get(f"CPU_group_{b}_{pg_id}", 0) for b in range(4)] == [0, 1.0, 0, 1.0]
    finally:
        engines.shutdown()
        placement.remove()


def test_a_slow_engine_serves_fewer_requests_and_outputs_keep_request_order(local_ray, tmp_path):
    from tests.stub_engines import EchoEngine, SlowSecondEngine

    cfg = _cfg(tmp_path, "SlowSecondEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2")
    placement, engines = _start(cfg)
    try:
        assert engines.capacities == [EchoEngine.CAPACITY] * 2
        requests = _requests(16)
        started = time.monotonic()
        outputs = engines.generate(requests)
        elapsed = time.monotonic() - started
    finally:
        engines.shutdown()
        placement.remove()
    records = _records(outputs)
    # Every request exactly once, in request order, with the engine's own prompt length.
    assert [r["rid"] for r in records] == [f"r{i}" for i in range(16)]
    assert [out.prompt_tokens for out in outputs] == [len(r.text) for r in requests]
    assert [out.engine_index for out in outputs] == [r["engine"] for r in records]
    served = [sum(r["engine"] == e for r in records) for e in (0, 1)]
    # Contiguous halves would give 8 and 8, and the step would last 4 slow calls (4 s).
    assert served[0] > served[1], served
    slow_calls = max(r["call"] for r in records if r["engine"] == 1)
    assert served[1] <= slow_calls * EchoEngine.CAPACITY
    assert elapsed >= slow_calls * SlowSecondEngine.SLOW_S


def test_a_slow_engine_serves_fewer_requests_also_when_the_step_fits_in_the_engines_at_once(local_ray, tmp_path):
    from tests.stub_engines import EchoEngine

    # 2 engines of capacity 2 and 4 requests: all of them fit at once, and equal contiguous halves
    # would give each engine 2 (engine of each request [0, 0, 1, 1]) and a step of one slow call.
    # The window is ceil(ceil(4 / 2) / 2) = 1 request per engine: r0 goes to engine 0, r1 to the
    # slow engine 1, and engine 0, back at once, takes r2, then r3, while engine 1 still sleeps.
    cfg = _cfg(tmp_path, "SlowSecondEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2")
    placement, engines = _start(cfg)
    try:
        assert engines.capacities == [EchoEngine.CAPACITY] * 2 == [2, 2]
        outputs = engines.generate(_requests(4))
    finally:
        engines.shutdown()
        placement.remove()
    records = _records(outputs)
    assert [r["rid"] for r in records] == ["r0", "r1", "r2", "r3"]
    assert [out.engine_index for out in outputs] == [r["engine"] for r in records] == [0, 1, 0, 0]
    assert [r["call"] for r in records] == [1, 1, 2, 3]  # one request per call on each engine


def test_one_engine_gets_full_batches_in_order_and_pause_reaches_it(local_ray, tmp_path):
    from tests.stub_engines import EchoEngine

    cfg = _cfg(tmp_path, "EchoEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    placement, engines = _start(cfg)
    try:
        records = _records(engines.generate(_requests(5)))
        # Capacity 2: batches of 2, 2 and 1 requests, one call after the other, in request order.
        assert [(r["call"], r["rid"]) for r in records] == [(1, "r0"), (1, "r1"), (2, "r2"), (2, "r3"), (3, "r4")]
        assert EchoEngine.CAPACITY == 2

        engines.pause_generation()
        with pytest.raises(EngineError, match=r"(?s)rollout engine 0 \(node .*bundles \[0\].*generation is paused"):
            engines.generate(_requests(1))
        engines.continue_generation()
        assert _records(engines.generate(_requests(1)))[0]["call"] == 4  # the refused call did not count
    finally:
        engines.shutdown()
        placement.remove()


def test_a_stopped_step_aborts_the_calls_in_flight_through_the_actor(local_ray, tmp_path):
    """Dynamic sampling's stop: the callback stops the step at the first output; the three calls still in flight
    reach the engine's abort_requests (through its actor) and come back cut off, not after the engine's wait."""
    cfg = _cfg(tmp_path, "AbortableEchoEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    placement, engines = _start(cfg)
    seen = []

    def on_outputs(step, indices, outputs, seconds):
        seen.append((indices, step.stopped))
        step.stop()

    try:
        outputs = engines.generate(_requests(4), on_outputs=on_outputs)
        assert [o.finish_reason for o in outputs] == ["stop", "abort", "abort", "abort"]
        assert seen[0] == ([0], False) and sorted(i for i, _ in seen[1:]) == [[1], [2], [3]]
        assert all(stopped for _, stopped in seen[1:])
    finally:
        engines.shutdown()
        placement.remove()


def test_a_continuous_batching_engine_gets_requests_one_per_call_up_to_its_capacity(local_ray, tmp_path):
    from tests.stub_engines import ConcurrentEchoEngine

    cfg = _cfg(tmp_path, "ConcurrentEchoEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    placement, engines = _start(cfg)
    try:
        records = _records(engines.generate(_requests(8)))
    finally:
        engines.shutdown()
        placement.remove()
    assert [r["rid"] for r in records] == [f"r{i}" for i in range(8)]
    # 8 calls of one request each (the stub refuses more), at most capacity = 4 of them at once,
    # and 4 at once while the queue was full (each call lasts 1 s, far longer than sending the next).
    assert sorted(r["call"] for r in records) == list(range(1, 9))
    assert max(r["overlap"] for r in records) == ConcurrentEchoEngine.CAPACITY == 4


def test_engine_that_never_turns_healthy_fails_start_up_within_the_timeout(local_ray, tmp_path):
    cfg = _cfg(tmp_path, "NeverHealthyEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2")
    # Engine 0 answers True at its first poll; engine 1 never does.  The test waits the whole timeout: short, since
    # both actors are up before the clock starts and a health() call to a live actor takes milliseconds.
    timeout_s = 3.0  # engine 1 answers False at its first poll (milliseconds) and is asked again each second
    placement, engines = build_engines(cfg)
    try:
        # The clock starts once both constructors have returned (an actor answers a call only then): each actor is
        # a new Python process importing torch, which on a loaded machine can take longer than timeout_s.
        ray.get([actor.limits.remote() for actor in engines.actors], timeout=START_TIMEOUT_S)
        started = time.monotonic()
        with pytest.raises(EngineStartError) as info:
            engines.wait_until_healthy(timeout_s)
        elapsed = time.monotonic() - started
    finally:
        engines.shutdown()
        placement.remove()
    message = str(info.value)
    assert message.startswith("1 of 2 rollout engine(s) failed to start")
    assert "rollout engine 1 (node " in message and "bundles [1]" in message
    assert "not healthy within --rollout-engine-start-timeout 3 s: health() returned False" in message
    assert "server: still loading shard 3 of 7" in message  # its log tail
    assert "engine 0 (" not in message
    assert timeout_s <= elapsed < timeout_s + 60


def test_engine_whose_constructor_raises_is_named_at_once(local_ray, tmp_path):
    cfg = _cfg(tmp_path, "FailingEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2")
    started = time.monotonic()
    with pytest.raises(EngineStartError) as info:
        _start(cfg, timeout_s=START_TIMEOUT_S)
    assert time.monotonic() - started < START_TIMEOUT_S / 2  # it does not wait for the timeout
    message = str(info.value)
    assert "rollout engine 1 (node " in message and "bundles [1]" in message
    assert "OSError" in message and "no server binary at /opt/server (stub)" in message


def test_shutdown_stops_what_an_engine_left_running_and_is_idempotent(local_ray, tmp_path, caplog):
    cfg = _cfg(tmp_path, "LeakyEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    placement, engines = _start(cfg)
    try:
        child = read_proc(_records(engines.generate(_requests(1)))[0]["child_pid"])
        assert child is not None
        with caplog.at_level(logging.WARNING, logger="slime.ray.engine_group"):
            engines.shutdown()
            engines.shutdown()  # a second call does nothing
        wait_for(lambda: read_proc(child.pid) is None or read_proc(child.pid).state == "Z", timeout_s=30,
                 what=f"the engine's child {child.pid} to exit")
        assert f"left 1 process(es) running after shutdown(); killed: pid {child.pid}" in caplog.text
    finally:
        placement.remove()


# ---------------------------------------------------------------------------------------
# an engine that dies mid-rollout with no other engine left: the mid-rollout re-sync
# ---------------------------------------------------------------------------------------


class _ResyncHook:
    """The driver's re-sync hook as the tests see it: pushes weights version ``version`` into every engine
    (``update_weights_from_tensor``, as a transport does) and ends with ``weights_updated()``, recording the
    group's state at each call; ``error`` makes it raise instead, ``ends_sync=False`` skips ``weights_updated``."""

    def __init__(self, engines, version: int = 1, error: Exception | None = None, ends_sync: bool = True):
        self.engines, self.version, self.error, self.ends_sync = engines, version, error, ends_sync
        self.seen: list[dict] = []

    def __call__(self) -> None:
        import torch

        self.seen.append({"serving": list(self.engines.serving),
                          "restarted": self.engines.fault_counts["engines_restarted"]})
        if self.error is not None:
            raise self.error
        ray.get([a.update_weights_from_tensor.remote([("version", torch.tensor(self.version))])
                 for a in self.engines.actors])
        if self.ends_sync:
            self.engines.weights_updated()


def test_one_engine_that_dies_mid_rollout_is_restarted_re_synced_and_serves_the_rest(local_ray, tmp_path):
    cfg = _cfg(tmp_path, "CrashingEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    placement, engines = _start(cfg)
    try:
        hook = _ResyncHook(engines)
        engines.set_resync(hook)
        records = _records(engines.generate(_requests(7)))
        # Capacity 2, one call at a time: call 1 serves r0 r1; call 2 (r2 r3) dies; after the restart and the
        # re-sync, the new server's calls serve r2 r3, r4 r5, r6 with the pushed weights (version 1).
        assert [r["rid"] for r in records] == [f"r{i}" for i in range(7)]  # each once, in request order
        assert [(r["life"], r["weights"], r["call"]) for r in records] == [
            (0, 0, 1), (0, 0, 1), (1, 1, 1), (1, 1, 1), (1, 1, 2), (1, 1, 2), (1, 1, 3)]  # fmt: skip
        assert hook.seen == [{"serving": [False], "restarted": 1}]  # called once, after the restart
        assert dict(engines.fault_counts) == {"engine_failures": 1, "requests_retried": 2, "engines_restarted": 1,
                                              "mid_rollout_resyncs": 1}
        assert engines.serving == [True]
        assert engines.epoch == 1  # restarted in place: the transports reconnect at the next sync (NCCL groups)
        assert [r["life"] for r in _records(engines.generate(_requests(2)))] == [1, 1]  # no further re-sync
        assert len(hook.seen) == 1 and engines.fault_counts["mid_rollout_resyncs"] == 1
    finally:
        engines.shutdown()
        placement.remove()


def test_with_a_survivor_the_restarted_engine_waits_for_the_next_sync_and_no_re_sync_runs(local_ray, tmp_path):
    """Engine 0 serves r0 r1 and dies on its second call (r4 r5), engine 1 answers only after that crash (the stub
    waits for it), so the schedule does not depend on which engine the machine runs first; the scheduler's health
    monitor gets a generous interval, so that a stalled machine does not take a healthy engine out."""
    cfg = _cfg(tmp_path, "CrashingWithASurvivorEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2",
               "--output-dir", str(tmp_path / "run"))
    placement, engines = _start(cfg)
    try:
        engines.scheduler.monitor_s = START_TIMEOUT_S
        hook = _ResyncHook(engines)
        engines.set_resync(hook)
        records = _records(engines.generate(_requests(12)))
        assert [r["rid"] for r in records] == [f"r{i}" for i in range(12)]
        assert all(r["life"] == 0 for r in records)  # engine 0 served only before it died
        assert [r["engine"] for r in records] == [0, 0] + [1] * 10
        assert hook.seen == [] and engines.fault_counts["mid_rollout_resyncs"] == 0
        assert engines.fault_counts["engine_failures"] == 1 and engines.fault_counts["engines_restarted"] == 1
        assert engines.fault_counts["requests_retried"] == 2  # r4 r5
        assert engines.serving == [False, True]
    finally:
        engines.shutdown()
        placement.remove()


def test_a_mid_rollout_re_sync_that_cannot_help_fails_clearly_and_cannot_loop(local_ray, tmp_path):
    """Engine 0 dies on every call.  Without a hook: today's error.  A hook that raises, or that returns without
    ``weights_updated()``: a clear error.  A working hook: the same requests go out again after each re-sync,
    each failure counting one attempt, so the third failure stops the step (MAX_ATTEMPTS = 3)."""
    cfg = _cfg(tmp_path, "AlwaysCrashingEngine", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1")
    placement, engines = _start(cfg)
    try:
        with pytest.raises(EngineError, match=r"no rollout engine is left to serve 3 request\(s\) \(#0 rid r0, #1 rid "
                                              r"r1, #2 rid r2\): engine 0 .*restarting"):
            engines.generate(_requests(3))
        assert engines.fault_counts["engine_failures"] == 1 and engines.fault_counts["mid_rollout_resyncs"] == 0

        engines.set_resync(_ResyncHook(engines, error=RuntimeError("weight push failed (stub)")))
        with pytest.raises(EngineError, match=r"re-syncing the restarted engines failed: RuntimeError: weight push "
                                              r"failed \(stub\)"):
            engines.generate(_requests(3))
        assert engines.fault_counts["engines_restarted"] == 1  # the restart finished before the hook ran

        engines.set_resync(_ResyncHook(engines, ends_sync=False))
        with pytest.raises(EngineError, match=r"no engine serves \(a re-sync hook must end with weights_updated"):
            engines.generate(_requests(3))

        hook = _ResyncHook(engines)
        engines.set_resync(hook)
        with pytest.raises(EngineError, match=rf"(?s)2 request\(s\) \(#0 rid r0, #1 rid r1\) failed on {MAX_ATTEMPTS} "
                                              r"engines; last: rollout engine 0 .*died \(stub\)"):
            engines.generate(_requests(3))
        # re-sync, fail (attempt 1), restart, re-sync, fail (2), restart, re-sync, fail (3): stop
        assert len(hook.seen) == MAX_ATTEMPTS == 3
        assert engines.fault_counts["mid_rollout_resyncs"] == 3
        assert engines.fault_counts["engine_failures"] == 1 + 2  # the first generate's, then two here
        with pytest.raises(TypeError, match="set_resync"):
            engines.set_resync("not callable")
    finally:
        engines.shutdown()
        placement.remove()
