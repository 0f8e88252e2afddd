"""Colocated memory hand-over (:mod:`slime.ray.colocate`): the call order of one rollout step with
recording stand-ins (through the driver's own loop), and the engine / trainer halves it relies on:
memory tags on a real TransformersEngine and ``offload(keep_weights=True)`` on the FSDP backend.
No Ray; the CUDA variants are skipped on CPU machines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from slime import train
from slime.backends.base import RankInfo
from slime.ray.colocate import ColocatedMemory
from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.manager import RolloutBatch
from slime.utils.arguments import parse_args
from slime.utils.metrics import MetricsLogger
from slime.utils.ppo_utils import GRPOConfig
from tests.spawn_ranks import spawn_ranks

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)

# ---------------------------------------------------------------------------------------
# the call order, with recording stand-ins for the trainer and engine groups
# ---------------------------------------------------------------------------------------


class _Recorder:
    """Stand-in trainer group, engine group and rollout manager writing every call into one list."""

    def __init__(self):
        self.calls: list[tuple] = []

    # trainer group
    def onload(self):
        self.calls.append(("trainers.onload",))

    def offload(self, keep_weights: bool = False):
        self.calls.append(("trainers.offload", f"keep_weights={keep_weights}"))

    def train(self, rollout_id, samples):
        self.calls.append(("trainers.train", rollout_id))
        return {"train/loss": 1.0}

    def update_weights(self, engines):
        self.calls.append(("trainers.update_weights",))

    # engine group
    def release_memory_occupation(self, tags=None):
        self.calls.append(("engines.release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("engines.resume", tags))

    # rollout manager
    def generate(self, rollout_id):
        self.calls.append(("rollout.generate", rollout_id))
        return RolloutBatch(samples=[], metrics={"rollout/reward_mean": 0.5})


def _one_step(rollout_id: int) -> list[tuple]:
    return [
        ("rollout.generate", rollout_id),  # engines hold everything
        ("engines.release", ["weights", "kv_cache", "cuda_graph"]),  # 1
        ("trainers.onload",),
        ("trainers.train", rollout_id),  # 2
        ("trainers.offload", "keep_weights=True"),  # 3: optimizer state off, weights stay
        ("engines.resume", ["weights"]),  # 4
        ("trainers.update_weights",),
        ("trainers.offload", "keep_weights=False"),  # 5
        ("engines.resume", ["kv_cache", "cuda_graph"]),  # 6
    ]


def _run_loop(tmp_path: Path, enabled: bool) -> list[tuple]:
    """The start-up (trainer init + first sync) as ``train.setup`` does it, then ``train.loop``
    over 2 rollout steps."""
    cfg = parse_args(
        "--hf-checkpoint unused --num-rollout 2 --rollout-batch-size 2 --n-samples-per-prompt 2 "
        "--rollout-max-response-len 8 --global-batch-size 4 --colocate --no-progress-bar "
        "--train-backend fsdp --rollout-backend transformers".split()
    )
    rec = _Recorder()
    memory = ColocatedMemory(rec, rec, enabled=enabled)
    with memory.startup_phase():
        rec.calls.append(("trainers.init",))
    with memory.sync_phase():  # train.setup: engines start from --hf-checkpoint and catch up
        rec.update_weights(rec)
    run = train.Run(engines=rec, trainers=rec, rollout_manager=rec, memory=memory, start=0, num_rollout=2)
    with MetricsLogger(tmp_path, cfg.wandb, run_name="colocate") as metrics_log:
        train.loop(cfg, run, metrics_log)
    return rec.calls


def test_colocated_step_hands_memory_over_in_upstream_order(tmp_path):
    calls = _run_loop(tmp_path, enabled=True)
    startup = [
        ("engines.release", ["weights", "kv_cache", "cuda_graph"]),  # before the trainers load the model
        ("trainers.init",),
        ("trainers.offload", "keep_weights=True"),
        ("engines.resume", ["weights"]),
        ("trainers.update_weights",),
        ("trainers.offload", "keep_weights=False"),
        ("engines.resume", ["kv_cache", "cuda_graph"]),
    ]
    assert calls == startup + _one_step(0) + _one_step(1)


class _MidRolloutResync(_Recorder):
    """A rollout whose only engine dies once in step 0: the engine group calls the driver's re-sync hook
    (:func:`slime.train.resync_engines`, as ``train.setup`` wires it) in the middle of ``generate``.  The
    engines' free memory (``memory_info``) drops by 1 GiB at every call, so a re-measure would show."""

    def __init__(self):
        super().__init__()
        self.memory: ColocatedMemory | None = None
        self.free_gib = 100.0

    def memory_info(self):
        self.calls.append(("engines.memory_info",))
        self.free_gib -= 1.0
        return [{"gpus": 1, "free_gib": self.free_gib}]

    def generate(self, rollout_id):
        self.calls.append(("rollout.generate", rollout_id))
        if rollout_id == 0:
            train.resync_engines(self.memory, self, self)
            self.calls.append(("rollout.generate continues", rollout_id))
        return RolloutBatch(samples=[], metrics={})


def test_a_mid_rollout_resync_keeps_the_memory_order_and_the_step_figures(tmp_path):
    cfg = parse_args(
        "--hf-checkpoint unused --num-rollout 1 --rollout-batch-size 2 --n-samples-per-prompt 2 "
        "--rollout-max-response-len 8 --global-batch-size 4 --colocate --no-progress-bar "
        "--train-backend fsdp --rollout-backend transformers".split()
    )
    rec = _MidRolloutResync()
    rec.memory = memory = ColocatedMemory(rec, rec, enabled=True, measure=True)
    with memory.startup_phase():
        rec.calls.append(("trainers.init",))
    with memory.sync_phase():
        rec.update_weights(rec)
    memory.metrics()  # the start-up's figures
    del rec.calls[:]
    run = train.Run(engines=rec, trainers=rec, rollout_manager=rec, memory=memory, start=0, num_rollout=1)
    with MetricsLogger(tmp_path, cfg.wandb, run_name="resync") as metrics_log:
        train.loop(cfg, run, metrics_log)
    resync = [  # engines resident, trainers offloaded -> the same state again, nothing measured
        ("engines.release", ["weights", "kv_cache", "cuda_graph"]),
        ("trainers.onload",),
        ("trainers.offload", "keep_weights=True"),
        ("engines.resume", ["weights"]),
        ("trainers.update_weights",),
        ("trainers.offload", "keep_weights=False"),
        ("engines.resume", ["kv_cache", "cuda_graph"]),
    ]
    step = _one_step(0)
    measured = [("engines.memory_info",), step[1], ("engines.memory_info",)]  # around the release
    assert rec.calls == [step[0], *resync, ("rollout.generate continues", 0), *measured, *step[2:]]
    record = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    # The start-up measured 99 and 98 GiB; the step's own train_phase 97 (resident) and 96 (released).
    assert record["memory/free_gib_engines_resident"] == 97.0 and record["memory/free_gib_engines_released"] == 96.0


def test_setup_wires_the_engines_resync_hook_to_the_colocated_resync(tmp_path, tiny_ckpt, monkeypatch):
    """``train.setup`` (workers and placement stood in for) hands the engines a hook that re-syncs in the
    colocated order, and only after its own first sync."""
    import contextlib
    import types

    cfg = parse_args(["--hf-checkpoint", str(tiny_ckpt), "--num-rollout", "1", "--rollout-batch-size", "2",
                      "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--colocate",
                      "--rollout-max-response-len", "8",
                      "--output-dir", str(tmp_path / "run"),
                      "--train-backend", "fsdp", "--rollout-backend", "transformers"])  # fmt: skip
    rec = _MidRolloutResync()
    hooks = []
    rec.init = lambda: rec.calls.append(("trainers.init",)) or 0
    rec.set_resync = lambda hook: (hooks.append(hook), rec.calls.append(("engines.set_resync",)))
    placement = types.SimpleNamespace(colocate=True, use_gpu=True, remove=lambda: None)
    monkeypatch.setattr(train, "cluster_num_gpus", lambda: 0)
    monkeypatch.setattr(train, "check_cpu_memory", lambda *args: None)
    monkeypatch.setattr(train, "create_placement_groups", lambda *args, **kwargs: placement)
    monkeypatch.setattr(train, "start_workers", lambda *args: (rec, rec))
    components = train.Components(engine_cls=types.SimpleNamespace(parity_check=False), backend_cls=None)
    manager = types.SimpleNamespace(engines=None, dataset=None)
    with contextlib.ExitStack() as cleanup:
        train.setup(cfg, components, manager, cleanup)
    assert len(hooks) == 1 and rec.calls[-2:] == [("engines.resume", ["kv_cache", "cuda_graph"]),
                                                  ("engines.set_resync",)]  # after the first sync
    del rec.calls[:]
    hooks[0]()
    assert rec.calls == [
        ("engines.release", ["weights", "kv_cache", "cuda_graph"]), ("trainers.onload",),
        ("trainers.offload", "keep_weights=True"), ("engines.resume", ["weights"]), ("trainers.update_weights",),
        ("trainers.offload", "keep_weights=False"), ("engines.resume", ["kv_cache", "cuda_graph"]),
    ]  # fmt: skip


def test_disabled_mode_makes_no_memory_calls(tmp_path):
    calls = _run_loop(tmp_path, enabled=False)
    assert calls == [
        ("trainers.init",), ("trainers.update_weights",),
        ("rollout.generate", 0), ("trainers.train", 0), ("trainers.update_weights",),
        ("rollout.generate", 1), ("trainers.train", 1), ("trainers.update_weights",),
    ]  # fmt: skip
    memory = ColocatedMemory(None, None, enabled=False)  # any call would raise AttributeError
    with memory.train_phase():
        pass
    with memory.sync_phase():
        pass


# ---------------------------------------------------------------------------------------
# engine half: memory tags on a real TransformersEngine
# ---------------------------------------------------------------------------------------


def _greedy_requests(processor) -> list[GenerateRequest]:
    texts = ["Find x.", "Solve for y if 2y + 3 = 11 and explain each step carefully."]
    return [
        GenerateRequest(
            processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}]),
            [],
            SamplingParams(max_new_tokens=8, temperature=0.0),
        )
        for text in texts
    ]


class _CheckpointPusher:
    """Stand-in trainer group whose weight sync pushes the checkpoint's tensors into one engine."""

    def __init__(self, ckpt_dir: Path):
        with safe_open(Path(ckpt_dir) / "model.safetensors", "pt") as f:
            self.tensors = [(name, f.get_tensor(name)) for name in f.keys()]

    def onload(self):
        pass

    def offload(self, keep_weights: bool = False):
        pass

    def update_weights(self, engine):
        half = len(self.tensors) // 2  # two buckets, as the trainer group sends them
        engine.update_weights_from_tensor(self.tensors[:half], flush_cache=False)
        engine.update_weights_from_tensor(self.tensors[half:], flush_cache=False)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_engine_generates_the_same_after_a_colocated_step(device, tiny_ckpt):
    """Driven by ColocatedMemory (the engine stands in for its group: same method signatures):
    generation is refused until every released tag is back, and the resumed engine, after the
    weight push, gives the same tokens and log-probs as before."""
    from slime.rollout.engines.hf_engine import TransformersEngine
    from slime.utils.processor import load_processor

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    engine = TransformersEngine(str(tiny_ckpt), device=device, dtype=dtype)
    requests = _greedy_requests(load_processor(tiny_ckpt))
    before = engine.generate(requests)
    held = torch.cuda.memory_allocated() if device == "cuda" else 0
    trainers = _CheckpointPusher(tiny_ckpt)
    memory = ColocatedMemory(trainers, engine, enabled=True)

    with memory.train_phase():
        if device == "cuda":
            assert torch.cuda.memory_allocated() < held  # the weights left the GPU
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):
            engine.generate(requests)
    with memory.sync_phase():
        if device == "cuda":
            assert torch.cuda.memory_allocated() == held  # the weights are back
        with pytest.raises(RuntimeError, match="kv_cache"):  # weights alone are not enough to generate
            engine.generate(requests)
        trainers.update_weights(engine)
    after = engine.generate(requests)

    assert [o.output_ids for o in after] == [o.output_ids for o in before]
    assert [o.output_log_probs for o in after] == [o.output_log_probs for o in before]


def test_engine_weights_tag_alone_round_trips(tiny_ckpt):
    from slime.rollout.engines.hf_engine import TransformersEngine
    from slime.utils.processor import load_processor

    engine = TransformersEngine(str(tiny_ckpt))
    requests = _greedy_requests(load_processor(tiny_ckpt))
    before = engine.generate(requests)
    engine.release_memory_occupation(["weights"])
    with pytest.raises(RuntimeError, match=r"\['weights'\]"):
        engine.generate(requests)
    engine.resume_memory_occupation(["weights"])
    _CheckpointPusher(tiny_ckpt).update_weights(engine)
    after = engine.generate(requests)
    assert [(o.output_ids, o.output_log_probs) for o in after] == [(o.output_ids, o.output_log_probs) for o in before]


@pytest.mark.parametrize("method", ["release_memory_occupation", "resume_memory_occupation"])
def test_engine_unknown_tag_raises_and_changes_nothing(method, tiny_ckpt):
    from slime.rollout.engines.hf_engine import TransformersEngine
    from slime.utils.processor import load_processor

    engine = TransformersEngine(str(tiny_ckpt))
    requests = _greedy_requests(load_processor(tiny_ckpt))[:1]
    with pytest.raises(ValueError, match=r"unknown memory tag\(s\) \['kv-cache'\].*'kv_cache'"):
        getattr(engine, method)(["weights", "kv-cache"])
    assert engine.generate(requests)  # nothing was released
    engine.release_memory_occupation()  # None: every tag
    with pytest.raises(ValueError, match="'bogus'"):
        engine.resume_memory_occupation(["bogus"])
    with pytest.raises(RuntimeError, match=r"\['cuda_graph', 'kv_cache', 'weights'\]"):
        engine.generate(requests)  # all still released
    engine.resume_memory_occupation([])  # [] means every tag too (SGLang)
    assert engine.generate(requests)


# ---------------------------------------------------------------------------------------
# trainer half: FSDP offload(keep_weights=True) keeps the weights the sync reads
# ---------------------------------------------------------------------------------------


def _offload_job(rank: int, device: str, ckpt_dir: Path, samples, out: Path) -> None:
    """One FSDP rank (world size 1) with a reference model: train, offload(keep_weights=True),
    sync, offload(), onload(), train; records where each kind of tensor is after each step."""
    from tests.test_fsdp_backend import make_backend

    # The process group exists (spawn_ranks), so the rendezvous address is never used.
    backend = make_backend(
        RankInfo(rank, 1, "127.0.0.1", 0, device), ckpt_dir, grpo=GRPOConfig(use_kl_loss=True, kl_loss_coef=0.1)
    )
    backend.init()
    backend.train(0, samples, num_steps=1)  # creates the AdamW moments

    def moments():
        return [v for state in backend.optimizer.state.values() for v in state.values() if v.dim() > 0]

    def where() -> dict[str, set[str]]:
        return {
            "policy": {p.device.type for p in backend.model.parameters()},
            "reference": {p.device.type for p in backend.ref_model.parameters()},
            "optimizer": {t.device.type for t in moments()},
        }

    def allocated() -> int:
        return torch.cuda.memory_allocated() if device == "cuda" else 0

    def sync() -> dict[str, torch.Tensor]:
        buckets = backend.iter_weight_buckets(1 << 20, device="cpu")
        return {name: t.clone() for bucket in buckets for name, t in bucket}

    def nbytes(tensors) -> int:
        return sum(t.to_local().numel() * t.element_size() for t in tensors)

    weights = sync()
    placements, memory = {"trained": where()}, {"trained": allocated()}
    backend.offload(keep_weights=True)
    placements["kept"], memory["kept"] = where(), allocated()
    synced = sync()
    same_weights = weights.keys() == synced.keys() and all(torch.equal(synced[n], w) for n, w in weights.items())
    backend.offload()
    placements["offloaded"], memory["offloaded"] = where(), allocated()
    backend.onload()
    placements["onloaded"] = where()
    metrics = backend.train(1, samples, num_steps=1)
    torch.save(
        dict(
            placements=placements,
            memory=memory,
            bytes={
                "policy": nbytes(backend.model.parameters()),
                "rest": nbytes(backend.ref_model.parameters()) + nbytes(moments()),
            },
            same_weights=same_weights,
            metrics=metrics,
        ),
        out / "offload.pt",
    )


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_fsdp_offload_keep_weights_moves_all_but_the_policy(device, tiny_ckpt, tmp_path):
    """On CPU offload is a no-op, so only the contract shows (sync and training work throughout);
    on CUDA the optimizer state and reference model leave the GPU first and the policy after the sync."""
    from tests.test_fsdp_backend import make_samples

    samples = make_samples(tiny_ckpt, [5, 3, 6, 4], images=[True, False, True, False])
    spawn_ranks(_offload_job, device, tiny_ckpt, samples, tmp_path, world_size=1, device=device)
    result = torch.load(tmp_path / "offload.pt")

    assert result["same_weights"]  # the sync after offload(keep_weights=True) reads the trained weights
    assert all(torch.isfinite(torch.tensor(v)) for v in result["metrics"].values()), result["metrics"]
    here, away = device, "cpu"  # on CPU both are "cpu": offload is a no-op there
    assert result["placements"] == {
        "trained": {"policy": {here}, "reference": {here}, "optimizer": {here}},
        "kept": {"policy": {here}, "reference": {away}, "optimizer": {away}},
        "offloaded": {"policy": {away}, "reference": {away}, "optimizer": {away}},
        "onloaded": {"policy": {here}, "reference": {here}, "optimizer": {here}},
    }
    if device == "cuda":
        memory, nbytes = result["memory"], result["bytes"]
        assert memory["trained"] - memory["kept"] >= nbytes["rest"] > 0, (memory, nbytes)
        assert memory["kept"] - memory["offloaded"] >= nbytes["policy"] > 0, (memory, nbytes)
