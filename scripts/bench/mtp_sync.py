#!/usr/bin/env python
"""MTP speculative decoding against a moving policy: engine/trainer log-prob gap and acceptance length before and
after a weight sync, on one server without MTP and one with it (issue 24, item 5).

  python scripts/bench/mtp_sync.py --model DIR [--servers none mtp --prompts 8 --response-len 128
      --perturb 0.01 --json FILE --out DIR]

Per server (``none``: the launcher's SGLang flags; ``mtp``: plus upstream's four speculative flags,
:data:`slime.rollout.engines.sglang.config.MTP_SPECULATIVE_FLAGS`), a colocated run on GPU 0 built by slime's own
driver (:func:`slime.driver.setup`: SGLang at its defaults with the memory saver, the FSDP trainer in bf16, CUDA-IPC
weight sync) goes through two rollout ids as the training loop does:

- ``before_sync``: the cache flushed, the parity probe sampled (:class:`slime.rollout.parity.EngineParityCheck`:
  ``--prompts`` geo3k rows with their image and as text alone, ``--response-len`` tokens at temperature 1), the
  acceptance of those requests read from their ``meta_info`` (``spec_verify_ct``...); then, in the
  training phase, the trainer's log-probs of those tokens (plain and with one rounding step: the gap and the
  trainer's floor, and the gate's verdict at its default bounds) and the policy moved: every trainer parameter
  times ``1 + perturb * n``, n ~ N(0, 1), seeded per tensor; then the sync (engines release their memory, the
  trainer pushes its weights, which hold no MTP layer: the draft keeps its start-up weights from SGLang's CPU copy);
- ``after_sync``: the same probe and figures against the moved policy.

Figures: one JSON line per server and phase (``check: mtp_sync``) with the gaps, ``spec`` (acceptance), the
probe's seconds and tokens, and the sync's seconds.  On a random model the acceptance length is about 1 at
temperature 1 whatever the draft (docs/results/h200_real_width.md, item 5); the gaps and the sync are the point.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

DATA = ROOT / "examples" / "geo3k_vlm" / "data"
LAUNCHER_SGLANG = ("--sglang-ep-size", "1", "--sglang-max-running-requests", "512", "--sglang-disable-custom-all-reduce")
"""The launcher's ``--sglang-*`` flags on one GPU (examples/geo3k_vlm/run_geo3k_qwen35.sh) but its
``--sglang-mem-fraction-static 0.7`` (:data:`LAUNCHER_MEM_FRACTION`, ``--mem-fraction-static`` here)."""
LAUNCHER_MEM_FRACTION = 0.7


def run_argv(model: str, server: str, prompts: int, response_len: int, out: Path,
             mem_fraction: float = LAUNCHER_MEM_FRACTION) -> list[str]:
    """The slime flags of one server's run: the launcher's recipe on one GPU with the FSDP trainer, two rollout ids,
    the parity probe's size, SGLang's ``--mem-fraction-static``; ``server`` ``mtp`` adds the speculative flags as
    ``--sglang-*``."""
    from slime.rollout.engines.sglang.config import MTP_SPECULATIVE_FLAGS

    speculative = ["--sglang-" + f[2:] if f.startswith("--") else f for f in MTP_SPECULATIVE_FLAGS]
    return ["--hf-checkpoint", model, "--prompt-data", str(DATA), "--input-key", "problem", "--label-key", "answer",
            "--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--rm-type", "math",
            "--num-rollout", "2", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
            "--global-batch-size", "2", "--rollout-max-response-len", "8", "--rollout-temperature", "1.0",
            "--engine-parity-prompts", str(prompts), "--engine-parity-response-len", str(response_len),
            "--rollout-backend", "sglang", "--rollout-num-gpus-per-engine", "1", *LAUNCHER_SGLANG,
            "--sglang-mem-fraction-static", str(mem_fraction),
            *(speculative if server == "mtp" else []),
            "--train-backend", "fsdp", "--micro-batch-size", "1", "--bf16", "--gradient-checkpointing",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1", "--colocate",
            "--output-dir", str(out / server), "--no-progress-bar"]


def perturb_parameters(actor, rel: float, seed: int) -> int:
    """On a trainer actor: every parameter of its model (the rank's local shard) times ``1 + rel * n``, n ~ N(0, 1)
    drawn from a generator seeded with ``seed + i`` for the i-th parameter (zeros stay: the random model's norm
    weights); returns the parameters moved."""
    import torch

    models = actor.backend.model if isinstance(actor.backend.model, (list, tuple)) else [actor.backend.model]
    moved = 0
    with torch.no_grad():
        for model in models:
            for i, param in enumerate(model.parameters()):
                local = param.to_local() if hasattr(param, "to_local") else param.data
                gen = torch.Generator(device=local.device).manual_seed(seed + i)
                noise = torch.randn(local.shape, generator=gen, device=local.device, dtype=torch.float32)
                local.mul_((1 + rel * noise).to(local.dtype))
                moved += 1
    return moved


def probe(run, rollout_id: int) -> tuple[list, dict]:
    """The parity probe's samples at ``rollout_id`` and the engine's figures of them (the cache flushed first):
    seconds, tokens and the speculative figures of its requests (``spec``, None without speculative decoding)."""
    import ray

    from sglang_rollout_bench import engine_acceptance, record_spec_meta

    ray.get(run.engines.actors[0].__ray_call__.remote(record_spec_meta))
    engine_acceptance(run.engines)  # not what came before
    run.engines.flush_cache()
    t0 = time.monotonic()
    samples = run.parity.generate(run.engines, rollout_id)
    seconds = time.monotonic() - t0
    tokens = sum(len(s.response_token_ids) for s in samples)
    return samples, {"probe_s": round(seconds, 2), "probe_tokens": tokens, "spec": engine_acceptance(run.engines)}


def compare(run, samples, rollout_id: int, strict) -> dict:
    """The trainer side of the probe (in the training phase): the gate's metrics, and its verdict at ``strict``'s
    bounds (the check itself runs with bounds that never refuse, so that every figure comes out)."""
    from slime.rollout.parity import ParityGaps, verdict

    metrics = run.parity.compare(run.trainers, samples, rollout_id)
    gaps = ParityGaps(*(metrics[f"parity/{k}"] for k in ("logprob_gap_image", "logprob_gap_text",
                                                          "logprob_gap_image_max", "logprob_gap_text_max")),
                      int(metrics["parity/tokens_image"]), int(metrics["parity/tokens_text"]),
                      metrics["parity/trainer_floor_image"], metrics["parity/trainer_floor_text"])
    why = verdict(gaps, strict.engine_parity_max_gap, strict.engine_parity_max_ratio, strict.engine_parity_floor_factor)
    return {**{k: round(v, 5) for k, v in metrics.items()}, "verdict": why or "pass"}


def measure_server(server: str, args) -> None:
    import ray

    import sglang_rollout_bench
    from slime.arguments import parse_args
    from slime.driver import init_ray, make_run_dir, prepare, resolve_components, setup
    from sglang_rollout_bench import _emit

    for module in (sglang_rollout_bench, sys.modules.get(__name__)):  # Ray's workers cannot import the scripts by
        if module is not None and module.__name__ != "__main__":  # name: functions run in actors travel by value
            ray.cloudpickle.register_pickle_by_value(module)  # (__main__'s always do)

    cfg = parse_args(run_argv(args.model, server, args.prompts, args.response_len, Path(args.out),
                              args.mem_fraction_static))
    strict = cfg.parity
    cfg.parity = dataclasses.replace(strict, engine_parity_max_gap=1e9, engine_parity_max_ratio=1e9,
                                     engine_parity_floor_factor=1e9)
    components = resolve_components(cfg)
    rollout_manager = prepare(cfg)
    make_run_dir(cfg)
    started_ray = init_ray(cfg.cluster)
    with contextlib.ExitStack() as cleanup:
        if started_ray:
            cleanup.callback(ray.shutdown)
        cleanup.callback(rollout_manager.close)
        t0 = time.monotonic()
        run = setup(cfg, components, rollout_manager, cleanup)  # engines healthy, trainers loaded, first sync done
        start_s = round(time.monotonic() - t0, 1)
        sync_s, moved = None, [0]
        for phase, rollout_id in (("before_sync", 0), ("after_sync", 1)):
            samples, engine = probe(run, rollout_id)
            with run.memory.train_phase():
                trainer = compare(run, samples, rollout_id, strict)
                if phase == "before_sync":
                    moved = ray.get([a.__ray_call__.remote(perturb_parameters, args.perturb, args.seed)
                                     for a in run.trainers.actors])
            if phase == "before_sync":
                t1 = time.monotonic()
                with run.memory.sync_phase():
                    run.trainers.update_weights(run.engines)
                sync_s = round(time.monotonic() - t1, 2)
            _emit(args, "mtp_sync", {"server": server, "phase": phase, "start_s": start_s, "perturb": args.perturb,
                                     "parameters_moved": moved[0], "sync_s": sync_s if phase == "after_sync" else None,
                                     **engine, **trainer})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="the scaled checkpoint, with its MTP layer (scripts/tools/make_scaled_qwen35.py)")
    parser.add_argument("--servers", nargs="+", choices=["none", "mtp"], default=["none", "mtp"])
    parser.add_argument("--prompts", type=int, default=8, help="image prompts of the probe (and as many text ones)")
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--perturb", type=float, default=0.01, help="relative size of the policy's move")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mem-fraction-static", type=float, default=LAUNCHER_MEM_FRACTION,
                        help="SGLang's static memory share (default: the launcher's). The MTP server at 0.7 ran out of "
                             "memory at start-up on an 80 GB H100 (docs/results/h100_issue30_run3/mtp-sync-oom.txt)")
    parser.add_argument("--json", default=None, help="append the figures to this JSON-lines file")
    parser.add_argument("--out", default="/tmp/mtp-sync", help="folder for the runs' logs")
    args = parser.parse_args(argv)
    if "mtp" in args.servers:
        from slime.checkpoints.mtp import mtp_problem

        problem = mtp_problem(args.model)
        if problem:  # before any engine starts
            parser.error(f"--servers mtp drafts with the checkpoint's MTP layer, but --model {args.model} has none: "
                         f"{problem} (scripts/tools/make_scaled_qwen35.py adds one)")
    for server in args.servers:
        try:
            measure_server(server, args)
        except Exception as e:  # noqa: BLE001 - one server's failure leaves the other's figures
            import traceback

            traceback.print_exc()
            from sglang_rollout_bench import _emit

            _emit(args, "mtp_sync_error", {"server": server, "error": f"{type(e).__name__}: {e}"[-2000:]})


if __name__ == "__main__":
    main()
