"""SGLang engines in the real engine group (Ray, CPU bundles, the fake server of
:mod:`scripts.harness.fake_sglang_server`): per-request balancing under the engines' capacity, a prompt the servers refuse, and an engine that dies
mid-rollout.

A killed server (or a killed engine actor) must cost nothing: every request is answered exactly once
(the request ids of the outputs are compared with the ones sent), the dead engine's requests are served
by the other engine, the dead engine is restarted, and it serves again only after the next weight sync.
With one engine, the rollout waits for its restart and re-syncs it mid-rollout (the engine group's re-sync hook).
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

import pytest
import ray

from slime.rollout.scheduler import EngineError
from slime.rollout.engines.base import GenerateRequest, SamplingParams
from scripts.harness.fake_sglang import start_engine_group
from tests.process_tree import is_alive, read_proc, wait_for, wait_session_gone

START_TIMEOUT_S = 300.0


def _start(tmp_path, *sglang_flags: str, capacity: int = 4,
           engine: str = "scripts.harness.fake_sglang:FakeSGLangEngine"):
    return start_engine_group(tmp_path, *sglang_flags, num_engines=2, capacity=capacity, engine=engine,
                              timeout_s=START_TIMEOUT_S)


def _requests(n: int) -> list[GenerateRequest]:
    """Request ``i`` has the id ``r<i>`` as its first word and ``i % 3 + 1`` words."""
    params = SamplingParams(max_new_tokens=8)
    return [GenerateRequest(" ".join([f"r{i}"] + ["w"] * (i % 3)), [], params, rid=f"r{i}") for i in range(n)]


def _served_ids(outputs) -> list[str]:
    return [out.text.split(":")[0] for out in outputs]


def _server_pid(engines, index: int) -> int:
    return ray.get(engines.actors[index].__ray_call__.remote(lambda actor: actor.engine.server.pid))


def _server_info(engines, index: int) -> dict:
    return ray.get(engines.actors[index].__ray_call__.remote(lambda actor: actor.engine.client.server_info()))


def _stop(placement, engines):
    engines.shutdown()
    placement.remove()


def test_requests_are_balanced_over_sglang_engines_within_their_capacity(local_ray, tmp_path):
    placement, engines = _start(tmp_path, "--sglang-fake-delay-s", "0.3", capacity=3)
    try:
        assert engines.capacities == [3, 3]
        requests = _requests(24)
        outputs = engines.generate(requests)
        assert _served_ids(outputs) == [r.rid for r in requests]  # each answered once, in request order
        for i, out in enumerate(outputs):
            n = 1 + (i % 3 + 1) % 5
            assert out.output_ids == [10 + k for k in range(n)] and out.prompt_tokens == i % 3 + 1
        served = Counter(out.engine_index for out in outputs)
        assert served[0] + served[1] == 24 and min(served.values()) >= 8, served
        for index in (0, 1):
            info = _server_info(engines, index)
            assert info["max_running"] <= 3 and info["generate_calls"] == served[index]
    finally:
        _stop(placement, engines)


def test_a_refused_prompt_fails_the_rollout_naming_its_rid_and_no_engine(local_ray, tmp_path):
    """One prompt over the servers' ``--context-length`` among 12 (the others fit with their 8 new tokens): its
    batch is refused as a whole (SGLang 0.5.17's answer names no request), and the engine group's error names that
    prompt's rid and SGLang's reason, not just the first rids of its batch; no engine is taken out for it."""
    placement, engines = _start(tmp_path, "--sglang-context-length", "12", capacity=4)
    try:
        requests = _requests(12)
        requests[6] = GenerateRequest(" ".join(["r6"] + ["w"] * 12), [], requests[6].sampling_params, rid="r6")
        with pytest.raises(EngineError) as failed:
            engines.generate(requests)
        message = str(failed.value)
        assert "SGLang refused request rid 'r6'" in message, message
        assert "The input (13 tokens) is longer than the model's context length (12 tokens)." in message
        assert "1 of a batch of" in message
        assert engines.fault_counts["engine_failures"] == 0 and engines.serving == [True, True]
        assert _served_ids(engines.generate(_requests(12))) == [f"r{i}" for i in range(12)]  # still serving
    finally:
        _stop(placement, engines)


def _kill_later(delay_s: float, action) -> threading.Thread:
    thread = threading.Timer(delay_s, action)
    thread.start()
    return thread


@pytest.mark.parametrize("engine", ["scripts.harness.fake_sglang:FakeSGLangEngine",
                                    "scripts.harness.fake_sglang:SharedGpuFakeSGLangEngine"],
                         ids=["own-gpus", "one-shared-gpu"])
def test_a_server_killed_mid_rollout_loses_and_duplicates_no_sample(local_ray, tmp_path, engine):
    """Also with both engines on one GPU, where starts (the first one and the restart) take the GPU's start lock."""
    placement, engines = _start(tmp_path, "--sglang-fake-delay-s", "0.5", capacity=4, engine=engine)
    try:
        old_pid = _server_pid(engines, 1)
        killer = _kill_later(1.2, lambda: os.killpg(old_pid, signal.SIGKILL))
        requests = _requests(40)
        outputs = engines.generate(requests)
        killer.join()
        ids = _served_ids(outputs)
        assert sorted(ids) == sorted(r.rid for r in requests) and len(set(ids)) == 40  # none lost, none twice
        assert ids == [r.rid for r in requests] == [out.rid for out in outputs]
        served = Counter(out.engine_index for out in outputs)
        assert served[1] >= 4 and served[0] > served[1], served  # engine 1 served until it died
        assert engines.fault_counts["engine_failures"] == 1 and engines.fault_counts["engines_restarted"] == 1
        assert engines.fault_counts["requests_retried"] >= 1
        assert engines.serving == [True, False]  # restarted, waiting for the current weights
        assert _server_pid(engines, 1) != old_pid

        again = engines.generate(_requests(8))
        assert {out.engine_index for out in again} == {0}
        engines.weights_updated()  # what a weight sync ends with
        again = engines.generate(_requests(16))
        assert {out.engine_index for out in again} == {0, 1} and _served_ids(again) == [f"r{i}" for i in range(16)]
    finally:
        _stop(placement, engines)


def test_the_only_server_killed_mid_rollout_is_re_synced_and_loses_and_duplicates_no_sample(local_ray, tmp_path):
    placement, engines = start_engine_group(tmp_path, "--sglang-fake-delay-s", "0.5", num_engines=1, capacity=4,
                                            timeout_s=START_TIMEOUT_S)
    try:
        resyncs = []

        def resync():  # what the driver's hook ends with (trainers.update_weights -> weights_updated)
            resyncs.append((list(engines.serving), _server_pid(engines, 0)))
            engines.weights_updated()

        engines.set_resync(resync)
        old_pid = _server_pid(engines, 0)
        killer = _kill_later(1.2, lambda: os.killpg(old_pid, signal.SIGKILL))
        requests = _requests(24)
        outputs = engines.generate(requests)
        killer.join()
        ids = _served_ids(outputs)
        assert ids == [r.rid for r in requests] == [out.rid for out in outputs] and len(set(ids)) == 24
        assert len(resyncs) == 1 and resyncs[0][0] == [False] and resyncs[0][1] != old_pid  # after the restart
        assert engines.fault_counts["engine_failures"] == 1 and engines.fault_counts["engines_restarted"] == 1
        assert engines.fault_counts["mid_rollout_resyncs"] == 1 and engines.fault_counts["requests_retried"] >= 1
        assert engines.serving == [True] and _server_info(engines, 0)["generate_calls"] >= 1  # the new server served
    finally:
        _stop(placement, engines)


def test_a_killed_engine_actor_is_replaced_and_its_server_does_not_outlive_it(local_ray, tmp_path):
    placement, engines = _start(tmp_path, "--sglang-fake-delay-s", "0.5", capacity=4)
    try:
        old_pid = _server_pid(engines, 1)
        schedulers = [read_proc(pid) for pid in _server_info(engines, 1)["scheduler_pids"]]
        assert len(schedulers) == 1 and all(s is not None and s.sid == old_pid and is_alive(s) for s in schedulers)
        old_actor = engines.actors[1]
        killer = _kill_later(1.2, lambda: ray.kill(old_actor))
        outputs = engines.generate(_requests(40))
        killer.join()
        assert _served_ids(outputs) == [f"r{i}" for i in range(40)]
        assert engines.epoch == 1 and engines.actors[1] is not old_actor  # transports reconnect to it
        assert engines.fault_counts["engine_failures"] == 1 and engines.serving == [True, False]
        wait_for(lambda: not os.path.exists(f"/proc/{old_pid}"), timeout_s=60,
                 what="the old server to exit with its actor")
        wait_for(lambda: not any(is_alive(s) for s in schedulers), timeout_s=60,
                 what="the old server's scheduler stand-in (its child, in its session) to exit with it")
        assert not wait_session_gone(old_pid, timeout_s=60)
        assert _server_pid(engines, 1) != old_pid
    finally:
        _stop(placement, engines)
