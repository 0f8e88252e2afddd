"""Freezing parameters by name (--freeze-params-name-list / --only-train-params-name-list), on CPU.

- The selection rule on hand-made name maps: re.search over checkpoint names, fused tensors all-or-nothing, and the
  errors (a pattern matching nothing, a fused tensor matched in part, nothing left to train) naming flag and pattern.
- Both backends with a frozen vision tower: no gradient, no optimizer state, the tower's weights unchanged by a step
  (the rest changed), the weight export without the tower when asked, an exact resume, and a resume that changes the
  frozen set logs which tensors' optimizer state is dropped or started fresh.
- The trainer group's sync: the frozen tensors cross once per engine start (again after a restart), counted.
"""

from __future__ import annotations

import logging

import pytest
import torch

from slime.backends.freeze import select_frozen
from slime.backends.step import train_step
from slime.checkpoints import layout as ckpt
from slime.utils.config import ConfigError
from slime.weight_sync.base import WeightTransport
from scripts.harness.spawn_ranks import spawn_ranks
from tests.helpers import full_params, make_backend, make_megatron, make_samples, rank_share

VISUAL = r"model\.visual\."
NAMES = {  # backend name -> checkpoint names (one fused tensor)
    "visual.w": ["model.visual.blocks.0.attn.qkv.weight"],
    "lm.experts": ["model.language_model.layers.0.mlp.experts.0.up_proj.weight",
                   "model.language_model.layers.0.mlp.experts.1.up_proj.weight"],
    "lm.norm": ["model.language_model.norm.weight"],
}


def test_freeze_and_only_train_select_by_checkpoint_names():
    assert select_frozen(NAMES, freeze=[VISUAL], only_train=None) == {"visual.w"}
    assert select_frozen(NAMES, freeze=["norm", "visual"], only_train=None) == {"visual.w", "lm.norm"}
    assert select_frozen(NAMES, freeze=None, only_train=[r"experts\.\d+\."]) == {"visual.w", "lm.norm"}
    assert select_frozen(NAMES, freeze=None, only_train=None) == set()


def test_a_pattern_matching_nothing_is_an_error_naming_flag_and_pattern():
    with pytest.raises(ConfigError, match=r"--freeze-params-name-list: the pattern\(s\) \['vison'\] match no"):
        select_frozen(NAMES, freeze=[VISUAL, "vison"], only_train=None)
    with pytest.raises(ConfigError, match=r"--only-train-params-name-list: the pattern\(s\) \['mtp'\]"):
        select_frozen(NAMES, freeze=None, only_train=["mtp"])


def test_a_fused_tensor_matched_in_part_or_freezing_everything_is_an_error():
    with pytest.raises(ConfigError, match=r"lm\.experts \(1 of its 2 checkpoint tensors match"):
        select_frozen(NAMES, freeze=[r"experts\.0\."], only_train=None)
    with pytest.raises(ConfigError, match="nothing is left to train"):
        select_frozen(NAMES, freeze=["model"], only_train=None)


def test_both_flags_and_a_bad_regex_are_refused_at_parse_time():
    from slime.backends.config import TrainConfig

    with pytest.raises(ConfigError, match="not both"):
        TrainConfig(freeze_params_name_list=["a"], only_train_params_name_list=["b"])
    for name in ("freeze_params_name_list", "only_train_params_name_list"):  # the flag given without a pattern
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} was given no pattern"):
            TrainConfig(**{name: []})
    with pytest.raises(ConfigError, match=r"--only-train-params-name-list '\(\[' is not a Python regular expression"):
        TrainConfig(only_train_params_name_list=["(["])


# ---------------------------------------------------------------------------------------
# both backends, a frozen vision tower
# ---------------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _make(kind, rank_info, ckpt_dir, **kw):
    if kind == "fsdp":
        return make_backend(rank_info, ckpt_dir, **kw)

    return make_megatron(rank_info, ckpt_dir, **kw)


def _frozen_params(backend) -> list[torch.nn.Parameter]:
    return [p for n, p in backend.model.named_parameters() if n in backend.frozen]


def _weights(kind, backend) -> dict[str, torch.Tensor]:
    if kind == "fsdp":
        return full_params(backend.model)
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def _job(rank_info, kind, ckpt_dir, samples, root):
    records = _Records()
    logging.getLogger("slime.backends.freeze").addHandler(records)
    frozen = {"freeze_params_name_list": [VISUAL]}
    step0, step1 = rank_share(samples[:4], rank_info.rank, 1), rank_share(samples[4:], rank_info.rank, 1)
    save = root / "ckpt"
    out = {}
    first = _make(kind, rank_info, ckpt_dir, train=frozen, checkpoint={"save": str(save)})
    first.init()
    names = dict(first.model.named_parameters())
    out["frozen"], out["frozen_hf"] = sorted(first.frozen), sorted(first.frozen_hf_names)
    out["all_names"] = sorted(names)
    before = _weights(kind, first)
    train_step(first, 0, step0, num_steps=1)
    after = _weights(kind, first)
    out["unchanged"] = {n: torch.equal(before[n], after[n]) for n in before}
    out["grads_none"] = all(p.grad is None for p in _frozen_params(first))
    optim = first.optimizer if kind == "fsdp" else first.optimizer.optimizer
    in_optimizer = {id(p) for group in optim.param_groups for p in group["params"]}
    out["frozen_in_optimizer"] = sum(id(p) in in_optimizer or p in optim.state for p in _frozen_params(first))
    out["trained_with_state"] = sum(1 for p in names.values() if p.requires_grad and p in optim.state)
    out["sent_skip"] = [n for b in first.iter_weight_buckets(1 << 16, "cpu", skip_frozen=True) for n, _ in b]
    out["sent_all"] = [n for b in first.iter_weight_buckets(1 << 16, "cpu") for n, _ in b]
    first.save(0, ckpt.iteration_dir(save, 0))
    if rank_info.rank == 0:
        torch.save({"rollout_id": 0}, ckpt.rollout_state_path(save, 0))
        ckpt.mark_latest(save, 0)
    torch.distributed.barrier()
    out["metrics_a"] = train_step(first, 1, step1, num_steps=1)
    out["after_a"] = _weights(kind, first)
    del first
    second = _make(kind, rank_info, ckpt_dir, train=frozen, checkpoint={"load": str(save)})
    assert second.init() == 1
    out["metrics_b"] = train_step(second, 1, step1, num_steps=1)
    out["after_b"] = _weights(kind, second)
    out["warnings_same_set"] = list(records.messages)
    del second
    unfrozen = _make(kind, rank_info, ckpt_dir, checkpoint={"load": str(save)})
    assert unfrozen.init() == 1
    optim = unfrozen.optimizer if kind == "fsdp" else unfrozen.optimizer.optimizer
    visual = [p for n, p in unfrozen.model.named_parameters() if n in set(out["frozen"])]
    out["fresh_state"] = [not optim.state.get(p) or not bool(optim.state[p].get("exp_avg", torch.zeros(1)).any())
                          for p in visual]
    out["warnings_unfrozen"] = records.messages[len(out["warnings_same_set"]):]
    torch.save(out, root / f"{kind}_rank{rank_info.rank}.pt")


def _entry(rank, kind, world, args):
    from slime.backends.config import RankInfo

    _job(RankInfo(rank, world, "127.0.0.1", 0, "cpu"), kind, *args)


@pytest.fixture(scope="module", params=["fsdp", "megatron"])
def frozen_run(request, tiny_ckpt, tmp_path_factory):
    kind = request.param
    if kind == "megatron":
        pytest.importorskip("megatron.core")
    root = tmp_path_factory.mktemp(f"freeze_{kind}")
    samples = make_samples(tiny_ckpt, [5, 4, 3, 6, 4, 5, 2, 3], images=[True, False] * 4, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spawn_ranks(_entry, kind, 2, (tiny_ckpt, samples, root), world_size=2)
    finally:
        torch.set_num_threads(threads)
    return kind, [torch.load(root / f"{kind}_rank{r}.pt") for r in range(2)]


def test_a_frozen_vision_tower_has_no_gradient_no_optimizer_state_and_does_not_move(frozen_run):
    kind, ranks = frozen_run
    r0 = ranks[0]
    visual = [n for n in r0["all_names"] if "visual" in n]
    assert visual and set(r0["frozen"]) == set(visual)  # the tower, and nothing else, by its checkpoint names
    assert r0["frozen_hf"] and all(n.startswith("model.visual.") for n in r0["frozen_hf"])
    assert r0["grads_none"] and r0["frozen_in_optimizer"] == 0 and r0["trained_with_state"] > 0
    assert all(r0["unchanged"][n] for n in visual)
    assert not all(r0["unchanged"][n] for n in r0["all_names"] if n not in visual)  # the rest trained


def test_the_export_leaves_the_frozen_tensors_out_only_when_asked(frozen_run):
    _, ranks = frozen_run
    sent_all = {n for r in ranks for n in r["sent_all"]}
    sent_skip = {n for r in ranks for n in r["sent_skip"]}
    assert sent_skip == sent_all - set(ranks[0]["frozen_hf"])
    assert set(ranks[0]["frozen_hf"]) <= sent_all


def test_a_frozen_run_resumes_exactly(frozen_run):
    _, ranks = frozen_run
    for r in ranks:
        assert r["metrics_a"]["train/loss"] == r["metrics_b"]["train/loss"]
        assert r["metrics_a"]["train/grad_norm"] == r["metrics_b"]["train/grad_norm"]
        for name, value in r["after_a"].items():
            assert torch.equal(value, r["after_b"][name]), name
        assert not any("frozen set" in m for m in r["warnings_same_set"])


def test_a_resume_that_unfreezes_says_the_state_starts_fresh(frozen_run):
    _, ranks = frozen_run
    r0 = ranks[0]
    warned = [m for m in r0["warnings_unfrozen"] if "optimizer state starts fresh" in m]
    assert len(warned) == 1 and f"{len(r0['frozen_hf'])} tensors frozen in the checkpoint" in warned[0]
    assert r0["frozen_hf"][0] in warned[0]
    assert all(r0["fresh_state"])


# ---------------------------------------------------------------------------------------
# the trainer group's sync: frozen tensors once per engine start
# ---------------------------------------------------------------------------------------


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Actor:
    def __init__(self, names, frozen):
        self.send_weights = _Remote(lambda skip: [n for n in names if not (skip and n in frozen)])


class _Engines:
    epoch = 0


class _Transport(WeightTransport):
    """The base class's sync with nothing to connect, begin or end; the ranks' send is stood in for."""

    name = "stand-in"

    def send(self, buckets, rank, engines):
        raise NotImplementedError("the trainer group's ranks are stood in for")

    def connect(self, group, engines):
        pass

    def begin_sync(self, engines):
        pass

    def end_sync(self, engines):
        pass


def test_frozen_tensors_cross_the_sync_once_per_engine_start(monkeypatch):
    from slime.ray import trainer_group as tg

    monkeypatch.setattr(tg.ray, "get", lambda refs: refs)
    frozen = {"model.visual.a", "model.visual.b"}
    group = tg.TrainerGroup.__new__(tg.TrainerGroup)
    group.__dict__.update(transport=_Transport(), _connected_engines=None, _frozen_sent=None, _weight_names=None,
                          frozen_names=frozenset(frozen), _sync_counts=tg.collections.Counter(),
                          actors=[_Actor(["model.visual.a", "lm.x"], frozen), _Actor(["model.visual.b", "lm.y"], frozen)])
    engines = _Engines()
    sent = [sorted(group.update_weights(engines)) for _ in range(3)]
    assert sent == [["lm.x", "lm.y", "model.visual.a", "model.visual.b"], ["lm.x", "lm.y"], ["lm.x", "lm.y"]]
    assert group.sync_metrics() == {"weight_sync/syncs": 3.0, "weight_sync/full_syncs": 1.0,
                                    "weight_sync/tensors_sent": 8.0, "weight_sync/frozen_tensors_sent": 2.0}
    engines.epoch = 1  # an engine restarted: it gets the frozen tensors again, once
    sent = [sorted(group.update_weights(engines)) for _ in range(2)]
    assert sent == [["lm.x", "lm.y", "model.visual.a", "model.visual.b"], ["lm.x", "lm.y"]]
    assert group.sync_metrics()["weight_sync/frozen_tensors_sent"] == 2.0
