#!/usr/bin/env python
"""What slime's engine group adds to one SGLang engine's request path, on CPU (no GPU, no SGLang).

  python scripts/bench/engine_group_overhead.py [--requests 64 --delay-s 2 --image-kb 150 --rounds 2]

One :class:`slime.rollout.engines.sglang.engine.SGLangEngine` in the real engine group (Ray, a CPU bundle)
drives the fake SGLang 0.5.17 server of ``scripts/harness/fake_sglang_server.py``, which answers every ``/generate``
after ``--delay-s`` seconds (a stand-in for a generation; requests overlap, as in a continuous-batching
server).  ``--requests`` requests, each carrying one ``--image-kb`` KB base64 image as geo3k prompts do, are
sent two ways side by side:

1. ``RolloutEngineGroup.generate`` (one Ray call per request into the engine's actor, the group's queue
   and windows), ``--rounds`` times;
2. the same requests from a thread pool inside the engine's actor straight into ``SGLangEngine.generate``
   (the same HTTP calls, no Ray call per request).

Printed: seconds of each and the group's overhead over ``--delay-s`` and over the direct path.  With all
requests in flight at once both take about ``--delay-s``; a path that serialised requests would take a
multiple of it.  Runs of 2026-12-01 on the 2-core CPU machine while the test suite also ran (64 requests,
150 KB images, 2 s): group 2.29-2.89 s, direct 2.20-2.99 s (``docs/results/h200_sglang.md``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--delay-s", type=float, default=2.0, help="the fake server's time per request")
    parser.add_argument("--image-kb", type=int, default=150, help="size of each request's base64 image")
    parser.add_argument("--rounds", type=int, default=2, help="timed passes through the engine group")
    args = parser.parse_args(argv)

    import ray

    from slime.ray.config import ClusterConfig
    from slime.ray.placement import init_ray
    from slime.rollout.engines.base import GenerateRequest, SamplingParams
    from scripts.harness.fake_sglang import start_engine_group
    from scripts.harness.sglang_gpu import generate_in_actor

    work = Path(tempfile.mkdtemp(prefix="slime-group-overhead-"))
    started = init_ray(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1))
    placement, engines = start_engine_group(work, "--sglang-fake-delay-s", str(args.delay_s), num_engines=1,
                                            capacity=max(args.requests, 1), timeout_s=120.0)
    try:
        image = base64.b64encode(os.urandom(args.image_kb * 1000 * 3 // 4)).decode()
        requests = [GenerateRequest(f"r{i} find the area", [image], SamplingParams(max_new_tokens=8), rid=f"r{i}")
                    for i in range(args.requests)]
        engines.generate(requests[:4])  # warm-up: connections, the actor's threads
        group = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            engines.generate(requests)
            group.append(time.perf_counter() - t0)
        direct = ray.get(engines.actors[0].__ray_call__.remote(generate_in_actor, requests))["seconds"]
    finally:
        engines.shutdown()
        placement.remove()
        if started:
            ray.shutdown()
    figures = {"requests": args.requests, "delay_s": args.delay_s, "image_kb": args.image_kb,
               "group_s": [round(t, 3) for t in group], "direct_s": round(direct, 3),
               "group_over_delay_s": round(min(group) - args.delay_s, 3),
               "group_over_direct_s": round(min(group) - direct, 3)}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
