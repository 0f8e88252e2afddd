"""Two real SGLang engines sharing one GPU in the real engine group (Ray): one engine's server is killed mid-rollout.

Every request is answered exactly once (request ids compared), the other engine serves the dead one's requests,
the dead engine is restarted (a new server process, healthy again), and it serves after the next weight sync.
The model is the real-width scaled Qwen3.5-35B-A3B (the ``scaled_ckpt`` fixture), each engine at SGLang's defaults
with the launcher's flags (CUDA graphs) and 0.3 of the GPU.  Needs CUDA and an installed sglang.
``SLIME_GPU_FIGURES=FILE`` collects the figures.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from scripts.harness.sglang_gpu import HAVE_SGLANG, START_TIMEOUT_S, SharedGpuPlacement, figure, sglang_argv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not HAVE_SGLANG, reason="needs sglang (the GPU profile)"),
]
DATA = Path(__file__).resolve().parents[1] / "examples" / "geo3k_vlm" / "data"
MEM_FRACTION = 0.3
"""Of the GPU, per engine: two engines of the scaled model fit an H200."""
RESPONSE_TOKENS = 512
"""Per request: 96 requests at 16 in flight per engine take about 10 s at SGLang's defaults, so the kill at 2 s
lands mid-rollout (the 64 tokens of the tiny model's test would be done in about one)."""


def test_killing_one_of_two_engines_mid_rollout_loses_and_duplicates_nothing(scaled_ckpt, tmp_path):
    import ray

    from slime.arguments import parse_args
    from slime.ray.engine_group import RolloutEngineGroup
    from slime.rollout.engines.base import GenerateRequest, SamplingParams
    from slime.rollout.engines.sglang.engine import SGLangEngine

    cfg = parse_args([
        "--hf-checkpoint", str(scaled_ckpt), "--prompt-data", str(DATA), "--num-rollout", "1",
        "--rollout-batch-size", "1", "--rollout-max-response-len", str(RESPONSE_TOKENS), "--train-backend", "fsdp",
        "--rollout-backend", "sglang", "--rollout-num-gpus", "2", "--output-dir", str(tmp_path / "run"),
        "--sglang-server-concurrency", "16", *sglang_argv(MEM_FRACTION),
    ])  # fmt: skip
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False)
    engines = RolloutEngineGroup(SharedGpuPlacement([["0"], ["0"]]), functools.partial(SGLangEngine.from_spec,
                                                               cfg.engine_spec(SGLangEngine.parity_check)),
                                 SGLangEngine.max_concurrent_calls)
    try:
        t0 = time.monotonic()
        engines.wait_until_healthy(START_TIMEOUT_S)
        start_s = time.monotonic() - t0
        params = SamplingParams(max_new_tokens=RESPONSE_TOKENS, temperature=1.0)
        requests = [GenerateRequest(f"r{i} find the area of the triangle", [], params, rid=f"r{i}") for i in range(96)]
        pid = ray.get(engines.actors[1].__ray_call__.remote(lambda a: a.engine.server.pid))
        killer = threading.Timer(2.0, lambda: os.killpg(pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        outputs = engines.generate(requests)  # returns once engine 1 is up again
        generate_s = time.monotonic() - t0
        killer.join()
        served = Counter(out.engine_index for out in outputs)
        assert len(outputs) == 96 and all(out is not None and out.output_ids for out in outputs)
        assert [out.rid for out in outputs] == [r.rid for r in requests]  # each answered once, by SGLang's meta_info.id
        assert engines.fault_counts["engine_failures"] == 1 and engines.fault_counts["engines_restarted"] == 1
        assert engines.serving == [True, False]
        new_pid = ray.get(engines.actors[1].__ray_call__.remote(lambda a: a.engine.server.pid))
        assert new_pid != pid
        engines.weights_updated()
        again = engines.generate(requests[:32])
        assert {out.engine_index for out in again} == {0, 1}
        figure(check="kill_engine", start_s=round(start_s, 1), generate_with_restart_s=round(generate_s, 1),
               served=dict(served), retried=engines.fault_counts["requests_retried"],
               failures=engines.fault_counts["engine_failures"], restarted=engines.fault_counts["engines_restarted"])
    finally:
        engines.shutdown()
        if started:
            ray.shutdown()
