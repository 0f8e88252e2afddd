"""Colocated memory hand-over (:class:`slime.driver.ColocatedMemory`): the call order of one rollout step with
recording stand-ins (through the driver's own loop), and the engine / trainer halves it relies on:
memory tags on a real TransformersEngine and ``offload(keep_weights=True)`` on the FSDP backend.
No Ray; the CUDA variants are skipped on CPU machines."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from slime import driver
from slime.arguments import parse_args
from slime.backends.config import RankInfo
from slime.backends.handover import TRAINING_STATE, WEIGHTS, HandOver
from slime.backends.step import train_step
from slime.driver import ColocatedMemory
from slime.grpo.config import GRPOConfig
from slime.rollout.engines.base import GenerateRequest, SamplingParams
from slime.rollout.manager import RolloutBatch
from slime.utils.metrics import MetricsLogger, read_metrics
from slime.utils.timer import SYNC_SUB_PHASES, TRAIN_SUB_PHASES
from scripts.harness.spawn_ranks import spawn_ranks
from tests.helpers import make_backend, make_megatron, make_samples

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
    def onload(self, weights_only: bool = False):
        self.calls.append(("trainers.onload", "weights_only=True") if weights_only else ("trainers.onload",))

    def offload(self, keep_weights: bool = False):
        self.calls.append(("trainers.offload", f"keep_weights={keep_weights}"))

    def train(self, rollout_id, samples):
        self.calls.append(("trainers.train", rollout_id))
        return {"train/loss": 1.0}

    def update_weights(self, engines):
        self.calls.append(("trainers.update_weights",))

    # engine group
    def release_memory(self, tags=None, measure=False):
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
    """The start-up (trainer init + first sync) as ``driver.setup`` does it, then ``driver.loop``
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
    with memory.sync_phase():  # driver.setup: engines start from --hf-checkpoint and catch up
        rec.update_weights(rec)
    run = driver.Run(engines=rec, trainers=rec, rollout_manager=rec, memory=memory, start=0, num_rollout=2)
    with MetricsLogger(tmp_path, cfg.wandb, run_name="colocate") as metrics_log:
        driver.loop(cfg, run, metrics_log)
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


class _Slow(_Recorder):
    """The recorder with known waits (s): engines release 0.03 and resume 0.02; trainers onload 0.05, offload 0.04;
    a train call of 0.1 s whose trainer-side share (as the trainer group reports it) is 0.06 s of forward-backward
    and 0.04 s of transfer; the weight push 0.03."""

    def release_memory(self, tags=None, measure=False):
        time.sleep(0.03)
        return super().release_memory(tags, measure)

    def resume_memory_occupation(self, tags=None):
        time.sleep(0.02)
        super().resume_memory_occupation(tags)

    def onload(self, weights_only=False):
        time.sleep(0.05)
        super().onload(weights_only)

    def offload(self, keep_weights=False):
        time.sleep(0.04)
        super().offload(keep_weights)

    def train(self, rollout_id, samples):
        time.sleep(0.1)
        super().train(rollout_id, samples)
        return {"train/loss": 1.0, "perf/train_forward_backward_s": 0.06, "perf/train_transfer_s": 0.04}

    def update_weights(self, engines):
        time.sleep(0.03)
        super().update_weights(engines)


def test_the_train_and_sync_sub_phases_add_up_to_their_phase_and_reach_the_step_line(tmp_path, monkeypatch, caplog):
    """Each hand-over call's wait lands in its sub-phase, the sub-phases of ``TRAIN_SUB_PHASES`` add up to
    ``perf/train_time_s`` (and the sync's to ``perf/sync_time_s``) within 5 %, and the step's log line shows them."""
    monkeypatch.setattr(sys.modules[__name__], "_Recorder", _Slow)
    with caplog.at_level(logging.INFO, logger="slime"):
        _run_loop(tmp_path, enabled=True)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "perf/train_time_s" in r]
    assert len(records) == 2
    for r in records:
        assert 0.03 <= r["perf/train_engine_release_s"] < 0.03 + 0.05
        assert 0.05 <= r["perf/train_onload_s"] < 0.05 + 0.05
        assert 0.04 <= r["perf/train_offload_s"] < 0.04 + 0.05
        assert 0.04 <= r["perf/sync_offload_s"] < 0.04 + 0.05
        assert 0.04 <= r["perf/sync_engine_resume_s"] < 0.04 + 0.05  # two resumes of 0.02
        assert 0.03 <= r["perf/sync_push_s"] < 0.03 + 0.05
        train = sum(r.get(f"perf/train_{sub}_s", 0.0) for sub in TRAIN_SUB_PHASES)
        sync = sum(r.get(f"perf/sync_{sub}_s", 0.0) for sub in SYNC_SUB_PHASES)
        assert train == pytest.approx(r["perf/train_time_s"], rel=0.05)
        assert sync == pytest.approx(r["perf/sync_time_s"], rel=0.05)
    lines = [m for m in caplog.messages if m.startswith("step ")]
    assert len(lines) == 2
    assert re.search(r"train 0\.\d s \(release 0\.0, onload 0\.1, parity 0\.0, transfer 0\.0, fwd_bwd 0\.1, "
                     r"offload 0\.0\) \| sync 0\.\d s \(resume 0\.0, push 0\.0, offload 0\.0\)", lines[0]), lines[0]


class _MidRolloutResync(_Recorder):
    """A rollout whose only engine dies once in step 0: the engine group calls the driver's re-sync hook
    (:func:`slime.driver.resync_engines`, as ``driver.setup`` wires it) in the middle of ``generate``.  The
    engines' free memory (``memory_info``) drops by 1 GiB at every call, so a re-measure would show."""

    def __init__(self):
        super().__init__()
        self.memory: ColocatedMemory | None = None
        self.free_gib = 100.0

    def memory_info(self):
        self.calls.append(("engines.memory_info",))
        self.free_gib -= 1.0
        return self.free_gib

    def release_memory(self, tags=None, measure=False):  # the engine group measures around the release
        before = self.memory_info() if measure else None
        super().release_memory(tags)
        return None if before is None else (before, self.memory_info())

    def generate(self, rollout_id):
        self.calls.append(("rollout.generate", rollout_id))
        if rollout_id == 0:
            driver.resync_engines(self.memory, self, self)
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
    run = driver.Run(engines=rec, trainers=rec, rollout_manager=rec, memory=memory, start=0, num_rollout=1)
    with MetricsLogger(tmp_path, cfg.wandb, run_name="resync") as metrics_log:
        driver.loop(cfg, run, metrics_log)
    resync = [  # engines resident, trainers offloaded -> the same state again, nothing measured
        ("engines.release", ["weights", "kv_cache", "cuda_graph"]),
        ("trainers.onload", "weights_only=True"),  # the optimizer state stays off the GPU
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
    """``driver.setup`` (workers and placement stood in for) hands the engines a hook that re-syncs in the
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
    monkeypatch.setattr(driver, "cluster_num_gpus", lambda: 0)
    monkeypatch.setattr(driver, "check_cpu_memory", lambda *args: None)
    monkeypatch.setattr(driver, "create_placement_groups", lambda *args, **kwargs: placement)
    monkeypatch.setattr(driver, "start_workers", lambda *args: (rec, rec))
    components = driver.Components(engine_cls=types.SimpleNamespace(parity_check=False), backend_cls=None)
    manager = types.SimpleNamespace(engines=None, dataset=None)
    with contextlib.ExitStack() as cleanup:
        driver.setup(cfg, components, manager, cleanup)
    assert len(hooks) == 1 and rec.calls[-2:] == [("engines.resume", ["kv_cache", "cuda_graph"]),
                                                  ("engines.set_resync",)]  # after the first sync
    del rec.calls[:]
    hooks[0]()
    assert rec.calls == [
        ("engines.release", ["weights", "kv_cache", "cuda_graph"]), ("trainers.onload", "weights_only=True"),
        ("engines.resume", ["weights"]), ("trainers.update_weights",),
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

    def onload(self, weights_only: bool = False):
        pass

    def offload(self, keep_weights: bool = False):
        pass

    def update_weights(self, engine):
        half = len(self.tensors) // 2  # two buckets, as the trainer group sends them
        engine.update_weights_from_tensor(self.tensors[:half], flush_cache=False)
        engine.update_weights_from_tensor(self.tensors[half:], flush_cache=False)


class _OneEngineGroup:
    """Stand-in engine group of one engine: the group's memory calls onto the engine's."""

    def __init__(self, engine):
        self.engine = engine

    def release_memory(self, tags=None, measure=False):
        self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags=None):
        self.engine.resume_memory_occupation(tags)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_engine_generates_the_same_after_a_colocated_step(device, tiny_ckpt):
    """Driven by ColocatedMemory (the engine stands in for its group, :class:`_OneEngineGroup`):
    generation is refused until every released tag is back, and the resumed engine, after the
    weight push, gives the same tokens and log-probs as before."""
    from slime.data.processor import load_processor
    from slime.rollout.engines.hf_engine import TransformersEngine

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    engine = TransformersEngine(str(tiny_ckpt), device=device, dtype=dtype)
    requests = _greedy_requests(load_processor(tiny_ckpt))
    before = engine.generate(requests)
    held = torch.cuda.memory_allocated() if device == "cuda" else 0
    trainers = _CheckpointPusher(tiny_ckpt)
    memory = ColocatedMemory(trainers, _OneEngineGroup(engine), enabled=True)

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
    from slime.data.processor import load_processor
    from slime.rollout.engines.hf_engine import TransformersEngine

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
    from slime.data.processor import load_processor
    from slime.rollout.engines.hf_engine import TransformersEngine

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

    # The process group exists (spawn_ranks), so the rendezvous address is never used.
    backend = make_backend(
        RankInfo(rank, 1, "127.0.0.1", 0, device), ckpt_dir, grpo=GRPOConfig(use_kl_loss=True, kl_loss_coef=0.1)
    )
    backend.init()
    train_step(backend, 0, samples, num_steps=1)  # creates the AdamW moments

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
    backend.memory.offload(keep_weights=True)
    placements["kept"], memory["kept"] = where(), allocated()
    synced = sync()
    same_weights = weights.keys() == synced.keys() and all(torch.equal(synced[n], w) for n, w in weights.items())
    backend.memory.offload()
    placements["offloaded"], memory["offloaded"] = where(), allocated()
    backend.memory.onload()
    placements["onloaded"] = where()
    metrics = train_step(backend, 1, samples, num_steps=1)
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


# ---------------------------------------------------------------------------------------
# trainer half: the shared hand-over (slime.backends.handover.HandOver), weights-only onload
# ---------------------------------------------------------------------------------------


class _CountedGpu:
    """A backend whose "GPU" is a counter of GiB: 80 in all, the policy weights take 2, the training state
    (fp32 main weights, Adam moments, gradients) 6; ``engines`` holds the engine side's share.  Only the
    shared hand-over (:class:`HandOver`) runs; ``move_part`` records every move.  It stands in for the trainer group
    too (``offload`` / ``onload`` / ``train``, as :class:`ColocatedMemory` calls them)."""

    TOTAL, SIZES = 80.0, {WEIGHTS: 2.0, TRAINING_STATE: 6.0}

    def __init__(self):
        self.device = torch.device("cuda")  # a device object only: the CUDA calls are stood in for
        self.model = torch.nn.Linear(1, 1)
        self.resident = {WEIGHTS, TRAINING_STATE}  # where the stand-in says the parts are
        self.moves: list[tuple[str, bool]] = []
        self.engines: _CountedEngines | None = None
        self.memory = HandOver(self)

    def free_gib(self) -> float:
        return self.TOTAL - self.engines.held() - sum(self.SIZES[part] for part in self.resident)

    def move_part(self, part, onto_device):
        assert (part in self.resident) != onto_device, f"{part} moved twice the same way"
        self.resident ^= {part}
        self.moves.append((part, onto_device))

    def offload(self, keep_weights=False):
        self.memory.offload(keep_weights)

    def onload(self, weights_only=False):
        self.memory.onload(weights_only)

    def train(self, rollout_id, samples, num_steps):
        return self.memory.metrics()


class _CountedEngines:
    """The engine group's memory tags on the same counter: weights 3 GiB, KV cache 16, CUDA graphs 4, and
    ``context`` GiB that no tag releases (a restarted server's new CUDA context)."""

    SIZES = {"weights": 3.0, "kv_cache": 16.0, "cuda_graph": 4.0}

    def __init__(self):
        self.resident, self.context = set(self.SIZES), 0.0

    def held(self) -> float:
        return self.context + sum(self.SIZES[tag] for tag in self.resident)

    def release_memory(self, tags, measure=False):
        self.resident -= set(tags)

    def resume_memory_occupation(self, tags):
        self.resident |= set(tags)


def test_a_resync_onloads_only_the_weights_and_records_its_figures_apart(monkeypatch):
    """Start-up, step 0, a mid-rollout re-sync in step 1, step 2, through ColocatedMemory onto the shared
    hand-over: the re-sync never moves the training state, and each step's metrics hold the figures since
    the previous step's training, the re-sync's under ``perf/resync_*`` (the training phase's survive)."""
    import slime.backends.handover as handover

    trainer, engines = _CountedGpu(), _CountedEngines()
    trainer.engines = engines
    monkeypatch.setattr(handover, "free_gib", lambda device: trainer.free_gib())
    monkeypatch.setattr(handover, "synchronize_current_stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    memory = ColocatedMemory(trainer, engines, enabled=True)

    def step(rollout_id: int) -> dict[str, float]:
        with memory.train_phase():
            metrics = trainer.train(rollout_id, [], 1)
        with memory.sync_phase():
            pass
        return metrics

    with memory.startup_phase():  # engines out, then the trainer (all 8 GiB resident) keeps its weights
        pass
    with memory.sync_phase():
        pass
    assert trainer.resident == set() and engines.resident == set(_CountedEngines.SIZES)
    step0 = step(0)
    engines.context = 1.0  # the only engine died and came back in step 1's rollout
    trainer.moves.clear()
    with memory.resync_phase():
        assert trainer.resident == {WEIGHTS} and engines.resident == {"weights"}  # the push's peak
    assert trainer.moves == [(WEIGHTS, True), (WEIGHTS, False)]  # the training state stayed on the CPU
    assert trainer.resident == set() and engines.resident == set(_CountedEngines.SIZES)
    step1 = step(1)
    assert trainer.moves[2:4] == [(WEIGHTS, True), (TRAINING_STATE, True)]  # step 1 trains with everything
    step2 = step(2)

    # By hand: free = 80 - engine tags held - context - trainer parts held.
    startup = {  # offload(keep_weights=True) with the engines out, offload() with their weights in
        "perf/train_free_gib_before_offload_keep_weights": 72.0, "perf/train_free_gib_after_offload_keep_weights": 78.0,
        "perf/train_free_gib_before_offload": 75.0, "perf/train_free_gib_after_offload": 77.0,
    }  # fmt: skip
    assert step0 == {**startup, "perf/train_free_gib_before_onload": 80.0, "perf/train_free_gib_after_onload": 72.0}
    assert step1 == {
        **startup,  # step 0's offloads, the same figures as the start-up's; not the re-sync's
        "perf/resync_free_gib_before_onload_weights": 79.0, "perf/resync_free_gib_after_onload_weights": 77.0,
        "perf/resync_free_gib_before_offload": 74.0, "perf/resync_free_gib_after_offload": 76.0,
        "perf/train_free_gib_before_onload": 79.0, "perf/train_free_gib_after_onload": 71.0,
    }  # fmt: skip
    assert step2 == {  # step 1's offloads with the 1 GiB context; no re-sync figure left over
        "perf/train_free_gib_before_offload_keep_weights": 71.0, "perf/train_free_gib_after_offload_keep_weights": 77.0,
        "perf/train_free_gib_before_offload": 74.0, "perf/train_free_gib_after_offload": 76.0,
        "perf/train_free_gib_before_onload": 79.0, "perf/train_free_gib_after_onload": 71.0,
    }  # fmt: skip


def test_training_or_pushing_offloaded_parts_is_refused():
    """The shared hand-over tracks the parts on every device (here a CPU backend, where nothing moves):
    train() needs a full onload, the weight push and log-probs the weights."""
    trainer = _CountedGpu()
    trainer.device = torch.device("cpu")
    memory = trainer.memory
    memory.offload(keep_weights=True)
    memory.require("iter_weight_buckets()", training=False)  # the weights stayed
    with pytest.raises(RuntimeError, match=r"train\(\) needs this rank's training_state on the device.*onload\(\)"):
        memory.require("train()", training=True)
    memory.offload()
    with pytest.raises(RuntimeError, match=r"iter_weight_buckets\(\) needs this rank's weights"):
        memory.require("iter_weight_buckets()", training=False)
    memory.onload(weights_only=True)
    memory.require("iter_weight_buckets()", training=False)
    with pytest.raises(RuntimeError, match="training_state"):
        memory.require("train()", training=True)
    memory.onload()
    memory.require("train()", training=True)
    assert trainer.moves == [] and memory.metrics() == {}  # CPU: nothing moved, nothing measured


def _resync_job(rank: int, device: str, backend_name: str, ckpt_dir: Path, samples, resync: bool, out: Path) -> None:
    """One rank (world size 1): step 0 (train, offload(keep_weights=True), push, offload()), then with ``resync``
    the mid-rollout re-sync's trainer half (onload(weights_only=True), push, offload()), then step 1 (onload(),
    train); writes the weights after step 1, by Hugging Face name, and what the re-sync saw."""
    info = RankInfo(rank, 1, "127.0.0.1", 0, device)
    backend = (make_backend if backend_name == "fsdp" else make_megatron)(info, ckpt_dir)
    backend.init()

    def push() -> dict[str, torch.Tensor]:
        return {name: t.clone() for bucket in backend.iter_weight_buckets(1 << 20, device="cpu") for name, t in bucket}

    def allocated() -> int:
        return torch.cuda.memory_allocated() if device == "cuda" else 0

    train_step(backend, 0, samples, num_steps=1)  # creates the Adam moments
    backend.memory.offload(keep_weights=True)
    trained = push()
    backend.memory.offload()
    seen: dict = {"allocated": {"offloaded": allocated()}, "refused": {}}
    try:
        push()
    except RuntimeError as e:
        seen["refused"]["push"] = str(e)
    if resync:
        backend.memory.onload(weights_only=True)
        seen["allocated"]["weights_only"] = allocated()
        seen["same_push"] = push().keys() == trained.keys() and all(
            torch.equal(t, trained[n]) for n, t in push().items())
        try:
            train_step(backend, 1, samples, num_steps=1)
        except RuntimeError as e:
            seen["refused"]["train"] = str(e)
        backend.memory.offload()
    backend.memory.onload()
    seen["allocated"]["onloaded"] = allocated()
    metrics = train_step(backend, 1, samples, num_steps=1)
    torch.save(dict(weights=push(), seen=seen, metrics=metrics), out / f"resync_{resync}.pt")


@pytest.mark.parametrize(("backend_name", "device"), [
    ("fsdp", "cpu"), ("megatron", "cpu"), pytest.param("fsdp", "cuda", marks=CUDA.marks),
])  # fmt: skip
def test_a_resync_leaves_the_next_training_step_unchanged(backend_name, device, tiny_ckpt, tmp_path):
    """The weights after a training step that follows a mid-rollout re-sync are those of a run without it (bit
    for bit on CPU): the re-sync pushes the trained weights, and the next onload brings the optimizer state
    back.  On CUDA the weights-only onload brings back less than the full one (Adam's fp32 moments alone are
    twice the fp32 parameters).  (Megatron on CUDA, bf16 with the distributed optimizer:
    ``tests/test_megatron_gpu.py``.)"""
    if backend_name == "megatron":
        pytest.importorskip("megatron.core")

    samples = make_samples(tiny_ckpt, [5, 3, 6, 4], images=[True, False, True, False])
    for resync in (False, True):
        spawn_ranks(_resync_job, device, backend_name, tiny_ckpt, samples, resync, tmp_path, world_size=1,
                    device=device)
    plain, resynced = (torch.load(tmp_path / f"resync_{r}.pt") for r in (False, True))

    seen = resynced["seen"]
    assert seen["same_push"]  # the re-sync pushed the weights step 0 trained
    assert "weights on the device" in seen["refused"]["push"]  # offload() took them: no push without an onload
    assert "training_state on the device" in seen["refused"]["train"]  # no training on a weights-only onload
    assert plain["weights"].keys() == resynced["weights"].keys()
    if device == "cpu":
        assert all(torch.equal(resynced["weights"][n], w) for n, w in plain["weights"].items())
    else:  # CUDA kernels may reduce in another order from one process to the next
        worst = max((resynced["weights"][n].double() - w.double()).abs().max().item()
                    for n, w in plain["weights"].items())
        assert worst <= 1e-5, worst
        moved = seen["allocated"]
        weights = moved["weights_only"] - moved["offloaded"]
        assert 0 < weights and moved["onloaded"] - moved["weights_only"] >= 2 * weights * 0.9, moved
        assert "perf/resync_free_gib_after_onload_weights" in resynced["metrics"]
        assert not any(k.startswith("perf/resync_") for k in plain["metrics"])
    assert resynced["metrics"].keys() == plain["metrics"].keys() | {
        k for k in resynced["metrics"] if k.startswith("perf/resync_")}
