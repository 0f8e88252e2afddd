"""Training speed of the Megatron backend against the FSDP backend on the same geo3k-shaped samples (one GPU).

Model: a scaled Qwen3.5-35B-A3B (``slime.checkpoints.scaled_qwen35.scaled_config``: real width, head shapes, expert
shape and vision tower; ``--layers`` layers in the 3:1 GDN / attention pattern, ``--experts`` routed experts, top-8),
random weights saved once as a bf16 Hugging Face folder that both backends load.

Samples: ``--samples`` geo3k-shaped GRPO samples, the same for both: a chat prompt of ``--prompt-text``
text tokens around one image of ``--image-grid T H W`` patches (``T*H*W/4`` merged image tokens; the
geo3k images of the recipe give 256-400), a response of a length drawn uniformly from
``[--response-min, --response-max]`` (seeded), advantages +-1, rollout log-probs given
(``--use-rollout-logprobs``: the step is the training pass alone, no old-log-prob forward; ``--old-log-probs``
adds that forward, as the launcher's runs have it).  ``--recompute`` and ``--max-tokens-per-gpu`` set Megatron's
activation recomputation and packed micro-batch size: the launcher's own on one GPU are ``--recompute full`` and 8192
(4096 on a card under 120 GiB), so ``--old-log-probs --recompute full --max-tokens-per-gpu 4096`` is the compute of a
launcher step on an H100 (``docs/results/h200_train_phase.md``).

Each backend trains in its own process, as the recipe configures it on one GPU, bf16:

- ``megatron``: fla's Gated DeltaNet kernels, ``varlen_attn``, grouped-GEMM experts, megatron-core's DDP and
  distributed optimizer (fp32 main weights, fp32 gradient accumulation), packed micro-batches of up to
  ``--max-tokens-per-gpu`` tokens (``--use-dynamic-batch-size``, allowed at TP 1);
- ``fsdp``: the Hugging Face model under FSDP2 (fp32 master weights, bf16 compute, fp32 reduction), SDPA,
  one sample per micro-batch (the recipe's GDN limit, kept by the FSDP backend).

Reported per backend over ``--steps`` timed steps after ``--warmup``: the median step seconds (and each step's),
train tokens/s (prompt + response tokens of the timed steps / their seconds), model TFLOP/s and MFU = FLOPs /
seconds / ``--peak-tflops`` (790: the bf16 ceiling measured on these H200s, an 8192^3 matrix product on random data
at 769-798 TFLOP/s; the datasheet's dense bf16 is 989, also printed as ``mfu_datasheet``), with FLOPs from
``qwen35_shapes.flops_per_step`` (3 x forward: language model per token, causal attention per document, the LM head
at the response positions only, the vision tower per patch; with ``--old-log-probs`` 4 x forward; a recompute's
extra forward is not counted: it is not model work), peak GPU memory allocated and reserved
(``max_memory_allocated`` / ``max_memory_reserved``), the caching allocator's retries over the timed steps
(``perf/train_alloc_retries``), the last timed step's old-log-prob and forward-backward seconds and (Megatron) its
micro-batch clock (``micro_batch``: ``perf/micro_batch_*`` without the prefix), and the Megatron / FSDP ratio
(``dispatcher`` is Megatron's; an FSDP row repeats the flag).  ``--fresh-lengths`` gives every step new samples of the
same distribution (the launcher's steps never repeat their lengths); ``--moe-token-dispatcher-type``
picks megatron-core's MoE token dispatcher; ``--vision-attention sdpa`` puts the Megatron model's vision tower back
on transformers' one SDPA call per image and block (the alternative to its varlen path).
``--profile DIR`` writes the top CUDA kernels of one more step of each of ``--profile-backends`` (``torch.profiler``),
then the operators with the most device time by the Python line that called them.
Each step's time is printed as it ends, so a run cut off by a time limit still shows how far it got.

Usage (megatron-core, fla and their dependencies on PYTHONPATH, CUDA_HOME set for fla's tilelang backward):
    python scripts/bench/megatron_vs_fsdp.py --json OUT/bench.jsonl --profile OUT/profile
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen35_shapes import flops_per_step  # noqa: E402

from slime.backends.step import train_step  # noqa: E402
from slime.checkpoints.scaled_qwen35 import scaled_config  # noqa: E402


def write_checkpoint(folder: Path, layers: int, experts: int) -> None:
    """A random-initialised scaled Qwen3.5-35B-A3B, bf16 safetensors, built on the GPU."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    config = scaled_config(layers, experts)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def make_samples(config, args, seed: int = 0) -> list:
    """Geo3k-shaped samples (module docstring): token ids, one image's pixels and grid, a response; ``seed`` draws
    the lengths and values (the same seed, the same samples)."""
    from slime.data.sample import Sample

    gen = torch.Generator().manual_seed(seed)
    vision, vocab = config.vision_config, config.text_config.vocab_size
    t, h, w = args.image_grid
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    merged = t * h * w // vision.spatial_merge_size ** 2
    samples = []
    for i in range(args.samples):
        text = torch.randint(0, vocab - 1000, (args.prompt_text,), generator=gen).tolist()
        half = args.prompt_text // 2
        prompt = text[:half] + [config.vision_start_token_id] + [config.image_token_id] * merged + \
            [config.vision_end_token_id] + text[half:]
        length = int(torch.randint(args.response_min, args.response_max + 1, (1,), generator=gen))
        samples.append(Sample(
            index=i, group_index=i // 2, prompt="", label="", images=["<bench>"], prompt_token_ids=prompt,
            multimodal_inputs={"pixel_values": torch.randn(t * h * w, patch_dim, generator=gen),
                               "image_grid_thw": torch.tensor([[t, h, w]])},
            response_token_ids=torch.randint(0, vocab - 1000, (length,), generator=gen).tolist(),
            rollout_log_probs=[-12.0] * length, loss_mask=[1] * length, advantage=1.0 if i % 2 else -1.0,
        ))
    return samples


def step_work(samples: list, arch, old_log_probs: bool) -> tuple[int, float]:
    """The tokens (prompt + response) of one step over ``samples`` and its model FLOPs (module docstring)."""
    tokens = [len(s.prompt_token_ids) + s.response_length for s in samples]
    patches = [int(s.multimodal_inputs["image_grid_thw"].prod()) for s in samples]
    flops = flops_per_step(arch, tokens, lm_head_tokens=sum(s.response_length for s in samples), image_patches=patches)
    # + the no-grad forward (a third of the 3 x forward); a recompute's forward is not counted
    return sum(tokens), flops * (4 / 3 if old_log_probs else 1)


def build_backend(name: str, rank_info, ckpt: Path, args):
    from slime.backends.config import CheckpointConfig, OptimizerConfig, TrainConfig, TrainerSpec
    from slime.grpo.config import GRPOConfig

    def spec(train: TrainConfig) -> TrainerSpec:
        return TrainerSpec(train=train, optimizer=OptimizerConfig(lr=1e-6, weight_decay=0.1, clip_grad=1.0),
                           grpo=GRPOConfig(), checkpoint=CheckpointConfig(hf_checkpoint=str(ckpt)),
                           rollout_temperature=1.0, num_rollout=100, steps_per_rollout=1)

    if name == "megatron":
        from slime.backends.megatron.backend import MegatronBackend
        from slime.backends.megatron.config import MegatronConfig

        train = TrainConfig(train_backend="megatron", bf16=True, use_rollout_logprobs=not args.old_log_probs,
                            use_dynamic_batch_size=True, max_tokens_per_gpu=args.max_tokens_per_gpu)
        recompute = dict(none={}, selective=dict(recompute_granularity="selective"),
                         full=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
        return MegatronBackend(rank_info, spec(train), MegatronConfig(
            accumulate_allreduce_grads_in_fp32=True, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            **recompute[args.recompute]))
    from slime.backends.fsdp.backend import FSDPBackend
    from slime.backends.fsdp.config import FSDPConfig

    train = TrainConfig(train_backend="fsdp", bf16=True, use_rollout_logprobs=not args.old_log_probs,
                        micro_batch_size=1)
    return FSDPBackend(rank_info, spec(train), FSDPConfig(attn_implementation="sdpa"))


def run_backend(rank: int, name: str, ckpt: str, args, out: str) -> None:
    """One backend in its own process: build, warm up, time ``--steps`` steps, optionally profile one.  Every step
    trains the seed-0 samples, or with ``--fresh-lengths`` samples of its own seed (the step's index)."""
    from transformers import AutoConfig

    from slime.backends.config import RankInfo
    from slime.models.qwen3_5.config import arch_from_hf_config

    config = AutoConfig.from_pretrained(ckpt)
    arch = arch_from_hf_config(json.loads((Path(ckpt) / "config.json").read_text()))
    same = make_samples(config, args)

    def samples_of(step: int) -> list:
        return make_samples(config, args, seed=step) if args.fresh_lengths and step else same

    backend = build_backend(name, RankInfo(0, 1, "127.0.0.1", 0, args.device), Path(ckpt), args)
    start = time.perf_counter()
    backend.init()
    if args.vision_attention == "sdpa":  # the alternative: transformers' one SDPA call per image and block
        from slime.models.qwen3_5.vision import use_vision_attention

        towers = [m for m in backend.model.modules() if type(m).__name__.endswith("VisionModel")]
        for tower in towers:
            use_vision_attention(tower, "sdpa")
        print(f"{name}: vision attention sdpa in {len(towers)} tower(s)", flush=True)
    init_s = time.perf_counter() - start
    print(f"{name}: built in {init_s:.1f} s", flush=True)
    cuda = args.device == "cuda"
    for k in range(args.warmup):
        start = time.perf_counter()
        train_step(backend, k, samples_of(k), num_steps=1)
        if cuda:
            torch.cuda.synchronize()
        print(f"{name}: warm-up step {k + 1}/{args.warmup} in {time.perf_counter() - start:.1f} s", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, work, retries, metrics = [], [], 0.0, {}
    for k in range(args.steps):
        samples = samples_of(args.warmup + k)
        start = time.perf_counter()
        metrics = train_step(backend, args.warmup + k, samples, num_steps=1)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        work.append(step_work(samples, arch, args.old_log_probs))
        retries += metrics.get("perf/train_alloc_retries", 0.0)
        print(f"{name}: timed step {k + 1}/{args.steps}: {work[-1][0]} tokens in {times[-1]:.2f} s", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan")
    profile = None
    if args.profile and name in args.profile_backends:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities, with_stack=True) as prof:
            train_step(backend, args.warmup + args.steps, same, num_steps=1)
            if cuda:
                torch.cuda.synchronize()
        profile = profile_text(prof.key_averages(), cuda) + call_site_text(prof.events(), cuda)
    torch.save({"times": times, "work": work, "alloc_retries": retries, "peak_gib": peak, "reserved_gib": reserved,
                "init_s": init_s, "metrics": metrics, "profile": profile}, Path(out) / f"{name}.pt")


KERNEL_KINDS = [
    ("attention", re.compile(r"sdpa|flash|fmha|attention|attn", re.I)),
    ("Gated DeltaNet / Triton", re.compile(r"chunk|delta|fla_|triton|fused_recurrent|conv1d", re.I)),
    ("matrix products", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|_mm_|matmul", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|cat_|index|gather|scatter", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|foreach", re.I)),
    ("reductions and norms", re.compile(r"reduce|norm|softmax", re.I)),
]
"""Kernel-name patterns of :func:`profile_text`'s breakdown, first match wins (attention kernels are CUTLASS ones
too; a copy or a ``clamp_max`` is an elementwise kernel template); the rest count as "other"."""

LAUNCH_QUEUE_WAIT = "Command Buffer Full"
"""The profiler's row for the CPU blocked on a full kernel-launch queue: booked as device time (of its own and of the
CPU ranges around it), though no kernel runs for it."""


def profile_text(averages, cuda: bool) -> str:
    """``torch.profiler``'s averages as text: the top operators by their own time (on CUDA: device time), then on CUDA
    the device time of the kernels alone (events without CPU time) by :data:`KERNEL_KINDS`, milliseconds and shares,
    and the top kernels.  The :data:`LAUNCH_QUEUE_WAIT` row is left out of all three (it led the fifth H100 run's
    table with 5.15 s, and its wait showed as 5.26 s of AdamW's device time: ``docs/results/h200_train_phase.md``)."""
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    rows = averages.table(sort_by=sort, row_limit=31).splitlines()
    table = "\n".join(row for row in rows if not row.strip().startswith(LAUNCH_QUEUE_WAIT))
    if not cuda:
        return table
    try:
        kernels = [(e.key, e.self_device_time_total / 1e3) for e in averages
                   if e.cpu_time_total == 0 and e.self_device_time_total > 0 and e.key != LAUNCH_QUEUE_WAIT]
    except AttributeError as e:  # a torch whose averages name these fields otherwise: the table alone
        return f"{table}\n(no kernel breakdown: {e})\n"
    kinds: dict[str, float] = {}
    for key, ms in kernels:
        kind = next((name for name, pattern in KERNEL_KINDS if pattern.search(key)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    total = sum(kinds.values())
    lines = [f"{kind:28s} {ms:10.1f} ms {ms / total:6.1%}" for kind, ms in sorted(kinds.items(), key=lambda x: -x[1])]
    top = sorted(kernels, key=lambda x: -x[1])[:15]
    return "\n".join([table, "", f"kernels alone: {total:.1f} ms of device time", *lines, "", "top kernels:",
                      *(f"{ms:10.1f} ms  {key[:110]}" for key, ms in top), ""])


PYTHON_FRAME = re.compile(r"\.py\(\d+\): ")
"""The name of a Python-function event of ``torch.profiler(with_stack=True)``: ``path/file.py(line): function``."""
CALL_SITE_FRAMES = re.compile(r"(slime|megatron|transformers|torch/(optim|autograd|nn/parallel))/")
"""Frames that :func:`call_site_text` prints: the project's, megatron-core's, transformers' and the optimizer /
autograd entry points (not the profiler's or the bench's own)."""


def call_site_text(events, cuda: bool, limit: int = 20, frames: int = 4) -> str:
    """Where the device time is spent, by call site: the profiled operators (``prof.events()`` of a
    ``with_stack=True`` profile) grouped by name and their innermost ``frames`` Python frames that match
    :data:`CALL_SITE_FRAMES` (read from the Python-function events above each operator, its ``cpu_parent`` chain),
    the ``limit`` groups with the most self device time (self CPU time without CUDA) first, each with its calls and
    milliseconds.  Kernels count as the self device time of the operator that launched them, so an element-wise kernel
    of the kernel table is found here under the operator and line that launched it.  Operators with no such frame
    above them (autograd's backward runs on a C++ thread) are listed as ``(no Python frame)``."""
    groups: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for e in events:
        own = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3
        if own <= 0 or e.name == LAUNCH_QUEUE_WAIT or PYTHON_FRAME.search(e.name):
            continue
        stack, parent = [], e.cpu_parent
        while parent is not None and len(stack) < frames:
            if PYTHON_FRAME.search(parent.name) and CALL_SITE_FRAMES.search(parent.name):
                stack.append(parent.name)
            parent = parent.cpu_parent
        total = groups.setdefault((e.name, tuple(stack)), [0.0, 0])
        total[0] += own
        total[1] += 1
    lines = ["", f"by call site (self {'device' if cuda else 'CPU'} ms, calls, operator, innermost frames):"]
    for (name, stack), (ms, calls) in sorted(groups.items(), key=lambda item: -item[1][0])[:limit]:
        lines.append(f"{ms:10.1f} ms {calls:7d}x  {name}")
        lines.extend(f"{'':22s}{frame}" for frame in stack or ["(no Python frame)"])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="Decoder layers (3 GDN : 1 attention).")
    parser.add_argument("--experts", type=int, default=128, help="Routed experts per layer (top-8).")
    parser.add_argument("--samples", type=int, default=32, help="Samples per optimizer step.")
    parser.add_argument("--prompt-text", type=int, default=96, help="Text tokens of each prompt.")
    parser.add_argument("--image-grid", type=int, nargs=3, default=[1, 36, 36], metavar=("T", "H", "W"),
                        help="Patch grid of each prompt's image (merged tokens = T*H*W/4).")
    parser.add_argument("--response-min", type=int, default=256, help="Shortest response, tokens.")
    parser.add_argument("--response-max", type=int, default=1536, help="Longest response, tokens.")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384, help="Megatron's packed micro-batch budget.")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                        help="Megatron's activation recomputation: none, selective (core attention), or full (the "
                        "launcher's default on GPUs: --recompute-granularity full --recompute-method uniform "
                        "--recompute-num-layers 1; CUDA only). The FSDP backend keeps its own.")
    parser.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default=None,
                        help="Megatron's MoE token dispatcher (default: the backend's, allgather at EP = 1).")
    parser.add_argument("--vision-attention", choices=["model", "sdpa"], default="model",
                        help="The vision tower's attention: the model's (varlen on CUDA bf16: all images of a "
                        "micro-batch in one call a block) or sdpa (transformers' one call per image, the old path).")
    parser.add_argument("--fresh-lengths", action="store_true",
                        help="Every step after the first trains new samples (response lengths and values drawn with "
                        "the step's index as seed), as the launcher's steps do; default: the same samples each step.")
    parser.add_argument("--old-log-probs", action=argparse.BooleanOptionalAction, default=False,
                        help="Each step first recomputes the old log-probs (a no-grad forward, as the launcher's "
                        "runs do) instead of taking the rollout's (--use-rollout-logprobs); --no-old-log-probs (the "
                        "default): the compute of a step with --skip-actor-forward-only too.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed steps first.")
    parser.add_argument("--steps", type=int, default=2, help="Timed steps (median reported).")
    parser.add_argument("--peak-tflops", type=float, default=790.0,
                        help="bf16 TFLOP/s ceiling for MFU (790: an 8192^3 bf16 matmul measured on an H200 here).")
    parser.add_argument("--backends", nargs="+", default=["megatron", "fsdp"], choices=["megatron", "fsdp"])
    parser.add_argument("--json", type=Path, default=None, help="Append one JSON line per backend here.")
    parser.add_argument("--profile", type=Path, default=None,
                        help="Write the top CUDA kernels of one more step of each of --profile-backends here.")
    parser.add_argument("--profile-backends", nargs="+", default=["megatron", "fsdp"], choices=["megatron", "fsdp"],
                        help="Which backends --profile profiles (each costs one more step).")
    parser.add_argument("--workdir", type=Path, default=None, help="Where the checkpoint goes (default: a temp dir).")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="Train this Hugging Face folder instead of the scaled model (a tiny one: a smoke run).")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of the script.")
    args = parser.parse_args()

    from transformers import AutoConfig

    from slime.models.qwen3_5.config import arch_from_hf_config
    from scripts.harness.spawn_ranks import spawn_ranks

    work = args.workdir or Path(tempfile.mkdtemp(prefix="slime-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint or work / "ckpt"
    if not (ckpt / "config.json").is_file():
        write_checkpoint(ckpt, args.layers, args.experts)
    config = AutoConfig.from_pretrained(ckpt)
    arch = arch_from_hf_config(json.loads((ckpt / "config.json").read_text()))
    samples = make_samples(config, args)
    tokens, flops = step_work(samples, arch, args.old_log_probs)
    print(f"model: {ckpt} ({arch.num_layers} layers, {arch.num_experts} experts); "
          f"step: {len(samples)} samples, {tokens} tokens "
          f"({sum(s.response_length for s in samples)} response); {flops / 1e12:.1f} TFLOP per step"
          + ("; new samples every step" if args.fresh_lengths else ""), flush=True)
    del samples
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    rows = {}
    for name in args.backends:
        spawn_ranks(run_backend, name, str(ckpt), args, str(work), world_size=1, device=args.device)
        result = torch.load(work / f"{name}.pt", weights_only=False)
        seconds, timed_tokens, timed_flops = sum(result["times"]), sum(t for t, _ in result["work"]), \
            sum(f for _, f in result["work"])
        rows[name] = dict(
            backend=name, layers=arch.num_layers, experts=arch.num_experts, samples=args.samples,
            tokens=round(timed_tokens / len(result["work"])), fresh_lengths=args.fresh_lengths,
            step_tokens=[t for t, _ in result["work"]],
            max_tokens_per_gpu=args.max_tokens_per_gpu, recompute=args.recompute, old_log_probs=args.old_log_probs,
            dispatcher=args.moe_token_dispatcher_type or "default", vision_attention=args.vision_attention,
            step_s=round(statistics.median(result["times"]), 3), step_s_all=[round(t, 3) for t in result["times"]],
            tokens_per_s=round(timed_tokens / seconds),
            tflops=round(timed_flops / seconds / 1e12, 1), mfu=round(timed_flops / seconds / 1e12 / args.peak_tflops, 4),
            mfu_datasheet=round(timed_flops / seconds / 1e12 / 989.0, 4),
            peak_gib=round(result["peak_gib"], 1), reserved_gib=round(result["reserved_gib"], 1),
            alloc_retries=result["alloc_retries"], init_s=round(result["init_s"], 1),
            micro_batches=result["metrics"].get("train/micro_batches"), loss=result["metrics"].get("train/loss"),
            old_log_probs_s=round(result["metrics"].get("perf/train_old_log_probs_s", 0.0), 3),
            forward_backward_s=round(result["metrics"].get("perf/train_forward_backward_s", 0.0), 3),
            micro_batch={k.removeprefix("perf/micro_batch_"): round(v, 4) for k, v in result["metrics"].items()
                         if k.startswith("perf/micro_batch_")},  # the last timed step's (Megatron's clock)
        )
        if result["profile"] and args.profile:
            (args.profile / f"{name}.txt").write_text(result["profile"])
        _emit(args, rows[name])  # now: a later backend cut off by a timeout leaves this one's figures
    if "megatron" in rows and "fsdp" in rows:
        fsdp, megatron = rows["fsdp"], rows["megatron"]
        _emit(args, {"megatron_over_fsdp": {"speedup": round(fsdp["step_s"] / megatron["step_s"], 2),
                                            "tokens_per_s": round(megatron["tokens_per_s"] / fsdp["tokens_per_s"], 2),
                                            "peak_memory": round(megatron["peak_gib"] / fsdp["peak_gib"], 2)}})


def _emit(args, row: dict) -> None:
    print(json.dumps(row), flush=True)
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
