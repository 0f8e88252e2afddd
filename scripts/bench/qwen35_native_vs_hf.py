"""Forward + backward speed of the native Megatron Qwen3.5 model vs transformers, same weights, same data.

Model: Qwen3.5-35B-A3B's layers at real width (hidden 2048, 16 query / 2 KV heads of 256, GDN 16 key /
32 value heads of 128, 256 experts top-8 of width 512, shared expert 512, vocab 248320) cut to
``--layers`` layers in the 3:1 pattern (default 4: 3 GDN + 1 attention), random weights, bf16.
transformers runs as in the image: grouped-GEMM experts, SDPA attention, Gated DeltaNet on its torch
path (fla hidden from it).  Ours: fla's GDN kernels, ``varlen_attn``, grouped-GEMM experts.

Each step: forward, ``cross_entropy(logits.float(), next tokens)``, backward, on ``--tokens`` tokens
(one sequence for both models; ours also packed as 4 documents).  Reported: median step time, tokens/s,
model TFLOP/s and MFU against ``--peak-tflops`` (default 989, H200 SXM dense bf16).

FLOPs per token, forward (multiply-add = 2 FLOPs; training = 3 x forward):

- every matmul with a weight: 2 x its active parameters: GDN in/out projections, attention
  q(+gate)/k/v/o projections, router, top-k experts (3 matrices each), shared expert and its gate,
  LM head (``hidden x vocab``);
- GDN core (recurrent form, per value head): state update ``S += k (beta (v - S^T k))^T`` (4 dk dv)
  and read-out ``S^T q`` (2 dk dv): 6 dk dv;
- causal attention core: ``QK^T`` and ``PV`` over the causal half: 2 x 2 x heads x head_dim x L / 2
  per token of a document of length L (on average over its tokens).

Usage (one GPU; fla, megatron-core and their dependencies on PYTHONPATH, CUDA_HOME set for tilelang):
    python scripts/bench/qwen35_native_vs_hf.py --tokens 4096 16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slime.models.qwen3_5.build import (  # noqa: E402
    initialize_single_process,
    native_from_hf_model,
    transformers_qwen35_without_fla,
)

HF_MODELING = transformers_qwen35_without_fla()

from slime.models.qwen3_5.config import Qwen35Kernels, arch_from_hf_config  # noqa: E402
from slime.models.qwen3_5.model import Qwen35Document, Qwen35Inputs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen35_shapes import flops_per_step  # noqa: E402  (the FLOP count)

from slime.checkpoints.scaled_qwen35 import scaled_config  # noqa: E402


def timed(step, warmup: int, iters: int) -> tuple[float, float]:
    """(median seconds per step, peak GiB) of ``step()`` after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="Tokens per step.")
    parser.add_argument("--layers", type=int, default=4, help="Decoder layers (3 GDN : 1 attention).")
    parser.add_argument("--experts", type=int, default=256, help="Routed experts per layer (top-8).")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps first.")
    parser.add_argument("--iters", type=int, default=5, help="Timed steps (median reported).")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="Peak bf16 TFLOP/s for MFU.")
    parser.add_argument("--skip-hf", action="store_true", help="Time only the native model.")
    parser.add_argument("--json", type=Path, default=None, help="Append one JSON line per measurement here.")
    parser.add_argument("--gdn-kernel", choices=["fla", "torch"], default="fla", help="Native GDN kernel.")
    parser.add_argument("--attention-kernel", choices=["varlen", "sdpa"], default="varlen",
                        help="Native attention kernel.")
    args = parser.parse_args()

    initialize_single_process("cuda")
    config = scaled_config(args.layers, args.experts)
    with torch.device("cuda"):
        torch.manual_seed(0)
        hf = HF_MODELING.Qwen3_5MoeForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa")
    native = native_from_hf_model(hf, kernels=Qwen35Kernels(gdn=args.gdn_kernel, attention=args.attention_kernel))
    arch = arch_from_hf_config(config.to_dict())
    print(f"model: {args.layers} layers, {args.experts} experts, "
          f"{sum(p.numel() for p in native.decoder.parameters()) / 1e9:.2f} B decoder params", flush=True)

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")

    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, arch.vocab_size - 1000, (tokens + 1,), generator=gen)
        inputs, labels = ids[:-1], ids[1:].cuda()
        runs = {"native_1doc": [Qwen35Document(inputs)],
                "native_4docs": [Qwen35Document(c) for c in inputs.chunk(4)]}

        def native_step(documents):
            packed = Qwen35Inputs.pack(documents, arch).to("cuda")
            logits = native(packed)[:, 0]
            F.cross_entropy(logits.float(), labels).backward()
            native.zero_grad(set_to_none=True)

        def hf_step():
            logits = hf(input_ids=inputs.view(1, -1).cuda()).logits[0]
            F.cross_entropy(logits.float(), labels).backward()
            hf.zero_grad(set_to_none=True)

        results = {}
        for name, documents in runs.items():
            seconds, peak = timed(lambda: native_step(documents), args.warmup, args.iters)
            results[name] = (seconds, peak, [d.input_ids.numel() for d in documents])
        if not args.skip_hf:
            seconds, peak = timed(hf_step, args.warmup, args.iters)
            results["hf"] = (seconds, peak, [tokens])
        for name, (seconds, peak, lengths) in results.items():
            flops = flops_per_step(arch, lengths)
            row = dict(model=name, tokens=tokens, step_ms=round(seconds * 1e3, 1),
                       tokens_per_s=round(tokens / seconds), tflops=round(flops / seconds / 1e12, 1),
                       mfu=round(flops / seconds / 1e12 / args.peak_tflops, 4), peak_gib=round(peak, 1))
            if "hf" in results and name != "hf":
                row["speedup_vs_hf"] = round(results["hf"][0] / seconds, 2)
            record(row)


if __name__ == "__main__":
    main()
