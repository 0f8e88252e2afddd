#!/usr/bin/env python
"""Where the engine/trainer log-prob gap of the real-width model comes from (issue 24, item 1).

  python scripts/bench/parity_floor.py --model DIR [--build] [--prompts 8] [--response-len 64] --json FILE

1. ``engine`` runs: slime's SGLang engine (its server plugin, so the multimodal-RoPE fix) at the launcher's
   flags (SGLang's defaults: FA3, CUDA graphs, flashinfer sampling) plus ``--enable-return-routed-experts``;
   then the same with ``SLIME_SGLANG_MROPE_FIX=0`` (``--engines`` picks).  Each samples the parity probe's
   prompts (geo3k rows with their image, and as text alone) at temperature 1 and keeps, per response token,
   the engine's log-prob, and per position the experts SGLang routed it to in every layer.
2. ``hf``: the transformers model on the same weights scores those tokens in float32 (the reference), in bf16,
   with one component at a time in bf16 (the rest float32), with the engine's routes forced (gate weights
   recomputed from the model's own router logits over the forced experts), and in float32 with the embeddings
   scaled by ``1 + 2^-8 n`` (n ~ N(0, 1): one bf16 rounding of the residual stream, a sensitivity probe).
3. ``native``: slime's Megatron model (``slime.models.qwen3_5``) from the same weights, bf16 (fla, varlen
   attention) and float32 (torch GDN, SDPA), and bf16 with the embedding noise.

Every variant prints, per prompt kind (image / text), the mean and max ``|log-prob - reference|`` over response
tokens (nats) against the engine and against HF float32, and per layer the share of positions whose top-k
expert set equals the reference's.  Figures go to stdout and, with ``--json``, as JSON lines.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch



ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from slime.backends.rounding import rounding_step_noise  # noqa: E402

DATA = ROOT / "examples" / "geo3k_vlm" / "data"
JSON_OUT: Path | None = None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The launcher's SGLang flags on one GPU (examples/geo3k_vlm/run_geo3k_qwen35.sh), SGLang's defaults otherwise.
LAUNCHER_FLAGS = ("--mem-fraction-static", "0.5", "--max-running-requests", "512", "--disable-custom-all-reduce")


def figure(**values) -> dict:
    line = json.dumps(values)
    print("FIGURE", line, flush=True)
    if JSON_OUT:
        with open(JSON_OUT, "a") as f:
            f.write(line + "\n")
    return values


# ----------------------------------------------------------------------------- prompts and engine


def probe_samples(model: Path, n: int):
    """The parity probe's prompts: ``n`` geo3k rows with their image, and the same rows as text alone."""
    from slime.rollout.parity import probe_prompts
    from slime.arguments import parse_args
    from slime.data.dataset import PromptDataset
    from slime.data.processor import load_processor

    cfg = parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(DATA), "--num-rollout", "1",
                      "--rollout-batch-size", "1", "--rollout-max-response-len", "8", "--train-backend", "fsdp",
                      "--rollout-backend", "transformers", "--rollout-num-gpus", "1", "--input-key", "problem",
                      "--label-key", "answer", "--multimodal-keys", '{"image": "images"}', "--apply-chat-template"])
    images, texts = probe_prompts(PromptDataset(cfg.data, load_processor(str(model)), seed=0), n)
    return images + texts, len(images)


def run_engine(name: str, model: Path, prompts, response_len: int, run_dir: Path, flags: tuple[str, ...],
               env: dict[str, str]) -> list:
    """Start slime's SGLang engine, sample every prompt, return samples with ``metadata['routes']`` (uint8
    ``[P + R - 1, layers, top_k]``: SGLang's routed experts of every position it computed)."""
    from slime.ray.placement import free_port
    from slime.rollout.engines.base import GenerateRequest, SamplingParams
    from slime.rollout.engines.sglang.engine import SGLangEngine
    from slime.rollout.engines.sglang.generation import generate_payload, parse_generate_response
    from slime.rollout.engines.sglang.launch import LOCALHOST, ServerSpec
    from slime.rollout.seeds import sampling_seed

    spec = ServerSpec(model_path=str(model), tp_size=1, host=LOCALHOST, port=free_port(), seed=0, colocated=True,
                      passthrough=(*LAUNCHER_FLAGS, *flags, "--enable-return-routed-experts"))
    started = time.monotonic()
    engine = SGLangEngine(spec, run_dir, capacity=128, gpu_ids=["0"], env=env)
    try:
        while not engine.health():
            if time.monotonic() - started > 900:
                raise RuntimeError("SGLang not healthy in 900 s:\n" + engine.log_tail())
            time.sleep(1.0)
        start_s = time.monotonic() - started
        graph_lines = []
        for log in run_dir.rglob("server.log"):
            graph_lines += [ln.strip()[-160:] for ln in log.read_text(errors="replace").splitlines()
                            if "cuda graph" in ln.lower() and ("elapsed" in ln.lower() or "begin" in ln.lower())]
        figure(check="engine_start", engine=name, seconds=round(start_s, 1), flags=list(spec.passthrough),
               mrope_fix=sorted({r.get("mrope_fix") for r in engine.reports if not r.get("main")}),
               cuda_graph_log=graph_lines[-4:])
        samples, t0 = [], time.monotonic()
        for i, prompt in enumerate(prompts):
            request = GenerateRequest(prompt.prompt, prompt.images, SamplingParams(
                max_new_tokens=response_len, temperature=1.0, sampling_seed=sampling_seed(0, 0, i, "parity")),
                rid=f"floor:{i}")
            payload = generate_payload(request)
            payload["return_routed_experts"] = True
            body = engine.client.generate(payload)
            out = parse_generate_response(body)
            if out.prompt_tokens != len(prompt.prompt_token_ids):
                raise RuntimeError(f"prompt {i}: SGLang saw {out.prompt_tokens} tokens, the processor "
                                   f"{len(prompt.prompt_token_ids)}")
            sample = prompt.clone_prompt()
            sample.response_token_ids, sample.rollout_log_probs = list(out.output_ids), list(out.output_log_probs)
            sample.loss_mask = [1] * len(out.output_ids)
            raw = base64.b64decode(body["meta_info"]["routed_experts"])
            routes = torch.from_numpy(np.frombuffer(raw, dtype=np.int32).copy())
            total = len(prompt.prompt_token_ids) + len(out.output_ids) - 1
            sample.metadata["routes"] = routes.view(total, -1).to(torch.uint8)  # [T - 1, L * k]
            samples.append(sample)
        figure(check="engine_generate", engine=name, seconds=round(time.monotonic() - t0, 1),
               tokens=sum(len(s.response_token_ids) for s in samples))
        return samples
    finally:
        engine.shutdown()


# ----------------------------------------------------------------------------- comparing


def gaps(samples, num_image: int, log_probs, reference, skip: set[int]) -> dict:
    """Mean / max ``|log_probs - reference|`` per kind over response tokens (vision-placeholder responses out)."""
    out = {}
    for kind, part in (("image", slice(0, num_image)), ("text", slice(num_image, None))):
        d = [abs(a - b) for s, lp, ref in zip(samples[part], log_probs[part], reference[part])
             if not skip.intersection(s.response_token_ids) for a, b in zip(lp, ref)]
        out[f"{kind}_gap"] = round(statistics.fmean(d), 5) if d else None
        out[f"{kind}_max"] = round(max(d), 4) if d else None
        out[f"{kind}_tokens"] = len(d)
    return out


def route_agreement(samples, routes, reference, top_k: int) -> dict:
    """Per layer: share of positions (of the first ``T - 1``) whose expert set equals the reference's."""
    same, total = None, 0
    for s, r, ref in zip(samples, routes, reference):
        n = min(r.shape[0], ref.shape[0])
        a = r[:n].view(n, -1, top_k).long().sort(-1).values
        b = ref[:n].view(n, -1, top_k).long().sort(-1).values
        eq = (a == b).all(-1).float().sum(0)  # [L]
        same = eq if same is None else same + eq
        total += n
    return {"route_same_per_layer": [round(float(x) / total, 4) for x in same]}


def gate(name: str, trainer: str, samples, num_image: int, plain, noisy, skip: set[int]) -> None:
    """The parity gate's verdict with ``plain`` as the trainer's log-probs and ``noisy`` as them with one rounding
    step on the embeddings (what :class:`slime.rollout.parity.EngineParityCheck` computes)."""
    from slime.rollout.parity import summarize, token_gaps, verdict

    keep = [not skip.intersection(s.response_token_ids) for s in samples]
    parts = [[i for i in range(a, b) if keep[i]] for a, b in ((0, num_image), (num_image, len(samples)))]
    engine = [token_gaps([samples[i] for i in p], [plain[i] for i in p]) for p in parts]
    floors = [token_gaps([samples[i] for i in p], [noisy[i] for i in p], [plain[i] for i in p]) for p in parts]
    gaps = summarize(*engine, *floors)
    figure(check="gate", engine=name, trainer=trainer, **{k: round(v, 5) for k, v in gaps.metrics().items()},
           verdict=verdict(gaps, max_gap=1.0, max_ratio=1.5, floor_factor=3.0))


# ----------------------------------------------------------------------------- transformers


class RouterProbe:
    """Captures (and optionally forces) the top-k experts of every transformers MoE router, one sample at a time."""

    def __init__(self, model):
        self.blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
        self.top_k = self.blocks[0].gate.top_k
        self.captured: list[torch.Tensor] = []
        self.forced: torch.Tensor | None = None  # [T', L * k] for the current sample
        self.handles = [b.gate.register_forward_hook(self._hook(i)) for i, b in enumerate(self.blocks)]

    def _hook(self, layer: int):
        def hook(mod, args, out):
            logits, weights, index = out
            if self.forced is not None:
                n = min(self.forced.shape[0], index.shape[0])
                forced = self.forced[:n].view(n, -1, self.top_k)[:, layer].to(index.device, torch.long)
                index = torch.cat([forced, index[n:]])
                probs = torch.softmax(logits.float(), -1).gather(-1, index)
                weights = (probs / probs.sum(-1, keepdim=True)).to(weights.dtype)
            self.captured.append(index.detach())
            return logits, weights, index
        return hook

    def take(self) -> torch.Tensor:
        """The current sample's routes as ``[T, L * k]`` uint8, and reset."""
        routes = torch.stack(self.captured, 1).flatten(1).to(torch.uint8).cpu()
        self.captured = []
        return routes

    def remove(self):
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def bf16_modules(modules):
    """The given modules in bf16 (inputs cast in, outputs cast back to float32); the rest as it is."""
    def cast(v, dtype):
        if torch.is_tensor(v) and v.is_floating_point():
            return v.to(dtype)
        if isinstance(v, tuple):
            return tuple(cast(x, dtype) for x in v)
        return v

    handles = []
    for m in modules:
        m.to(torch.bfloat16)
        handles.append(m.register_forward_pre_hook(
            lambda mod, a, kw: (cast(a, torch.bfloat16), {k: cast(v, torch.bfloat16) for k, v in kw.items()}),
            with_kwargs=True))
        handles.append(m.register_forward_hook(lambda mod, a, out: cast(out, torch.float32)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in modules:
            m.float()


@contextlib.contextmanager
def embedding_noise(embedding: torch.nn.Module, rel: float, seed: int = 1):
    """Scale the embedding output by ``1 + rel * n``, n ~ N(0, 1) per element (seeded, so every variant the same)."""
    g = {}

    def hook(mod, args, out):
        gen = g.setdefault(out.device, torch.Generator(device=out.device).manual_seed(seed))
        return out * (1 + rel * torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32)).to(out.dtype)

    h = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        h.remove()


def hf_score(model, probe: RouterProbe, samples, forced: list | None = None):
    """(log-probs per sample, routes per sample) under the transformers model, one sample per forward."""
    from slime.backends.fsdp.backend import build_model_inputs, response_log_probs

    device = next(model.parameters()).device
    lps, routes = [], []
    with torch.no_grad():
        for i, s in enumerate(samples):
            probe.forced = None if forced is None else forced[i]
            inputs = build_model_inputs([s], model.config, device)
            lp, _ = response_log_probs(model, inputs, 1.0)
            lps.append(lp[0, : s.response_length].float().tolist())
            routes.append(probe.take())
    probe.forced = None
    return lps, routes


def hf_phase(model_path: Path, engines: dict, num_image: int) -> dict:
    from transformers import AutoModelForImageTextToText

    t0 = time.monotonic()
    model = AutoModelForImageTextToText.from_pretrained(str(model_path), dtype=torch.float32).to(DEVICE).eval()
    skip = {model.config.image_token_id, model.config.video_token_id}
    probe = RouterProbe(model)
    lm = model.model.language_model
    layers = list(lm.layers)
    components = {
        "vision": [model.model.visual],
        "embed": [lm.embed_tokens],
        "norms": [m for l in layers for m in (l.input_layernorm, l.post_attention_layernorm)] + [lm.norm],
        "gdn": [l.linear_attn for l in layers if getattr(l, "linear_attn", None) is not None],
        "attention": [l.self_attn for l in layers if getattr(l, "self_attn", None) is not None],
        "router": [b.gate for b in probe.blocks],
        "experts": [b.experts for b in probe.blocks],
        "shared_expert": [m for b in probe.blocks for m in (b.shared_expert, b.shared_expert_gate)],
        "lm_head": [model.lm_head],
    }
    figure(check="hf_load", seconds=round(time.monotonic() - t0, 1))
    refs = {}
    for name, samples in engines.items():
        engine_lp = [s.rollout_log_probs for s in samples]
        engine_routes = [s.metadata["routes"] for s in samples]

        def report(variant, lps, routes, ref):
            row = {"check": "hf", "engine": name, "variant": variant,
                   "vs_engine": gaps(samples, num_image, lps, engine_lp, skip),
                   "vs_hf_fp32": gaps(samples, num_image, lps, ref[0], skip) if ref else None,
                   "routes_vs_engine": route_agreement(samples, routes, engine_routes, probe.top_k),
                   "routes_vs_hf_fp32": route_agreement(samples, routes, ref[1], probe.top_k) if ref else None}
            figure(**row)

        ref = hf_score(model, probe, samples)
        refs[name] = ref
        report("fp32", *ref, None)
        report("fp32_engine_routes", *hf_score(model, probe, samples, engine_routes), ref)
        with embedding_noise(lm.embed_tokens, 2 ** -8):
            report("fp32_embed_noise_2^-8", *hf_score(model, probe, samples), ref)
        for comp, modules in components.items():
            with bf16_modules(modules):
                report(f"bf16_{comp}_only", *hf_score(model, probe, samples), ref)
        model.to(torch.bfloat16)
        try:
            plain = hf_score(model, probe, samples)
            report("bf16", *plain, ref)
            report("bf16_engine_routes", *hf_score(model, probe, samples, engine_routes), ref)
            report("bf16_fp32_routes", *hf_score(model, probe, samples, ref[1]), ref)
            with rounding_step_noise(lm.embed_tokens):
                noisy = hf_score(model, probe, samples)
            report("bf16_rounding_step", *noisy, ref)
            gate(name, "hf_bf16", samples, num_image, plain[0], noisy[0], skip)
            replayed = hf_score(model, probe, samples, engine_routes)
            with rounding_step_noise(lm.embed_tokens):
                replayed_noisy = hf_score(model, probe, samples, engine_routes)
            report("bf16_engine_routes_rounding_step", *replayed_noisy, ref)
            gate(name, "hf_bf16_replay", samples, num_image, replayed[0], replayed_noisy[0], skip)
        finally:
            model.float()
    probe.remove()
    return {"model": model, "refs": refs, "skip": skip}


# ----------------------------------------------------------------------------- slime's Megatron model


def native_phase(hf: dict, engines: dict, num_image: int) -> None:
    from slime.backends.megatron.backend import pack_micro_batch
    from slime.routing_replay import RouteShape, with_packed_routes
    from slime.models.qwen3_5.build import initialize_single_process, native_from_hf_model
    from slime.models.qwen3_5.config import Qwen35Kernels

    initialize_single_process(DEVICE)
    hf_model, skip = hf["model"], hf["skip"]
    for dtype in (torch.bfloat16, torch.float32):
        t0 = time.monotonic()
        kernels = Qwen35Kernels.for_dtype(dtype, DEVICE)
        native = native_from_hf_model(hf_model, kernels=kernels, dtype=dtype).eval()
        arch = native.qwen_config.arch
        routers = [m for n, m in native.named_modules() if type(m).__name__.endswith("Router")]
        captured = []
        handles = [r.register_forward_hook(lambda mod, a, out: captured.append(out[1].detach())) for r in routers]
        top_k = hf_model.config.text_config.num_experts_per_tok
        figure(check="native_build", dtype=str(dtype), kernels=str(kernels), seconds=round(time.monotonic() - t0, 1),
               routers=len(routers))

        def score(samples, replay: bool = False):
            lps, routes = [], []
            with torch.no_grad():
                for s in samples:
                    mb = pack_micro_batch([s], [0], arch, torch.device(DEVICE))
                    if replay:
                        layers = hf_model.config.text_config.num_hidden_layers
                        s.rollout_routed_experts = s.metadata["routes"].view(-1, layers, top_k).numpy()
                        shape = RouteShape(layers, top_k, hf_model.config.text_config.num_experts)
                        mb = with_packed_routes(mb, [s.rollout_routed_experts], shape)
                    logits = native(mb.inputs)[:, 0].float()
                    lp = logits.log_softmax(-1).gather(-1, mb.targets[:, None])[:, 0]
                    lps.append(lp.tolist())
                    maps = [c[: mb.num_tokens] for c in captured]  # each [T, E] bool routing map
                    routes.append(torch.stack([m.int().topk(top_k, -1).indices for m in maps], 1)
                                  .flatten(1).to(torch.uint8).cpu())
                    captured.clear()
            return lps, routes

        try:
            for name, samples in engines.items():
                ref = hf["refs"][name]
                engine_lp = [s.rollout_log_probs for s in samples]
                engine_routes = [s.metadata["routes"] for s in samples]
                variants = [("plain", contextlib.nullcontext())]
                if dtype == torch.bfloat16:
                    variants.append(("rounding_step", rounding_step_noise(native.embedding)))
                scored = {}
                for variant, ctx in variants:
                    with ctx:
                        lps, routes = scored[variant] = score(samples)
                    figure(check="native", engine=name, dtype=str(dtype), variant=variant,
                           vs_engine=gaps(samples, num_image, lps, engine_lp, skip),
                           vs_hf_fp32=gaps(samples, num_image, lps, ref[0], skip),
                           routes_vs_engine=route_agreement(samples, routes, engine_routes, top_k),
                           routes_vs_hf_fp32=route_agreement(samples, routes, ref[1], top_k))
                if "rounding_step" in scored:
                    gate(name, "native_bf16", samples, num_image, scored["plain"][0], scored["rounding_step"][0], skip)
                    replayed = score(samples, replay=True)
                    with rounding_step_noise(native.embedding):
                        replayed_noisy = score(samples, replay=True)
                    figure(check="native", engine=name, dtype=str(dtype), variant="engine_routes",
                           vs_engine=gaps(samples, num_image, replayed[0], engine_lp, skip),
                           vs_hf_fp32=gaps(samples, num_image, replayed[0], ref[0], skip),
                           routes_vs_engine=route_agreement(samples, replayed[1], engine_routes, top_k),
                           routes_vs_hf_fp32=route_agreement(samples, replayed[1], ref[1], top_k))
                    gate(name, "native_bf16_replay", samples, num_image, replayed[0], replayed_noisy[0], skip)
        finally:
            for h in handles:
                h.remove()
            del native
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- main


ENGINES = {
    # name: (extra server flags, env)
    "defaults": ((), {}),
    "defaults_fix_off": (("--disable-cuda-graph",), {"SLIME_SGLANG_MROPE_FIX": "0"}),
    "triton_eager": (("--attention-backend", "triton", "--mm-attention-backend", "triton_attn", "--sampling-backend",
                      "pytorch", "--moe-runner-backend", "triton", "--disable-cuda-graph"), {}),
}


def main() -> None:
    global JSON_OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--build", action="store_true", help="build the scaled checkpoint at --model if absent")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="image prompts (and as many text prompts)")
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--engines", nargs="+", default=["defaults", "defaults_fix_off"], choices=list(ENGINES))
    parser.add_argument("--skip-native", action="store_true")
    parser.add_argument("--fake-engine", action="store_true", help="no SGLang: random responses (a smoke test)")
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/parity-floor"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    JSON_OUT = args.json
    from slime.models.qwen3_5.build import transformers_qwen35_without_fla

    transformers_qwen35_without_fla()  # the HF reference's Gated DeltaNet on its exact torch path (fla uses TF32)
    if args.build and not (args.model / "config.json").exists():
        from slime.checkpoints.scaled_qwen35 import build_scaled_checkpoint

        build_scaled_checkpoint(args.model, args.layers, args.experts)
    prompts, num_image = probe_samples(args.model, args.prompts)
    engines = {}
    if args.fake_engine:  # a CPU smoke test of the phases below: random responses, log-probs 0, random routes
        g = torch.Generator().manual_seed(0)
        cfg = json.loads((args.model / "config.json").read_text())["text_config"]
        samples = []
        for p in prompts:
            s = p.clone_prompt()
            s.response_token_ids = torch.randint(0, 200, (args.response_len,), generator=g).tolist()
            s.rollout_log_probs, s.loss_mask = [0.0] * args.response_len, [1] * args.response_len
            total = len(p.prompt_token_ids) + args.response_len - 1
            s.metadata["routes"] = torch.stack([torch.randperm(cfg["num_experts"], generator=g)[: cfg["num_experts_per_tok"]]
                                                for _ in range(total * cfg["num_hidden_layers"])]).view(total, -1).to(torch.uint8)
            samples.append(s)
        engines["fake"] = samples
        args.engines = []
    for name in args.engines:
        flags, env = ENGINES[name]
        try:
            engines[name] = run_engine(name, args.model, prompts, args.response_len, args.run_dir / name, flags, env)
        except Exception as e:  # noqa: BLE001 - one engine's failure leaves the others' figures
            figure(check="engine_error", engine=name, error=repr(e)[-2000:])
    args.run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({k: [(s.prompt_token_ids, s.response_token_ids, s.rollout_log_probs, s.metadata["routes"])
                    for s in v] for k, v in engines.items()}, args.run_dir / "engine_samples.pt")
    hf = hf_phase(args.model, engines, num_image)
    if not args.skip_native:
        try:
            native_phase(hf, engines, num_image)
        except Exception as e:  # noqa: BLE001
            import traceback

            figure(check="native_error", error=traceback.format_exc()[-3000:])


if __name__ == "__main__":
    main()
