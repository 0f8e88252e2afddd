import io
import json
import logging
import math
import struct
import sys
import time
import types

import numpy as np
import pytest
import torch
from PIL import Image

from slime.utils.config import ConfigError
from slime.utils.metrics import MetricsLogger, RolloutProgress, read_metrics, resolve_wandb_mode, reward_curve_figure
from slime.utils.metrics_config import WandbConfig

NO_WANDB = WandbConfig()


def _raw_lines(path):
    """The JSONL file parsed strictly (a bare NaN / Infinity token is an error)."""

    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def _pixels(path):
    with Image.open(path) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB")).copy()


# ---------------------------------------------------------------- metrics.jsonl


def test_jsonl_lines_equal_what_was_logged(tmp_path):
    logged = [
        (0, {"rollout/reward_mean": 0.25, "train/grad_norm": 1.5, "perf/rollout_time_s": 12.0}),
        (1, {"rollout/reward_mean": 0.5, "eval/geo3k/accuracy": 0.375, "rollout/truncated": 3}),
    ]
    before = time.time()
    with MetricsLogger(tmp_path / "run", NO_WANDB, "run") as logger:
        for step, metrics in logged:
            logger.log(step, metrics)
            # flushed at once: visible to a reader before close
            assert len(_raw_lines(tmp_path / "run" / "metrics.jsonl")) == step + 1
    after = time.time()

    lines = _raw_lines(tmp_path / "run" / "metrics.jsonl")
    assert len(lines) == 2
    for line, (step, metrics) in zip(lines, logged):
        assert list(line) == ["step", "time", *metrics]
        assert before <= line["time"] <= after
        assert {k: v for k, v in line.items() if k != "time"} == {"step": step, **metrics}
    assert isinstance(lines[1]["rollout/truncated"], int)


def test_resumed_run_appends_and_never_truncates(tmp_path):
    with MetricsLogger(tmp_path, NO_WANDB, "run") as logger:
        logger.log(0, {"rollout/reward_mean": 0.1})
        logger.log(1, {"rollout/reward_mean": 0.2})
    first_run_text = (tmp_path / "metrics.jsonl").read_text()

    with MetricsLogger(tmp_path, NO_WANDB, "run") as logger:
        logger.log(2, {"rollout/reward_mean": 0.3})

    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.startswith(first_run_text)
    assert [(r["step"], r["rollout/reward_mean"]) for r in _raw_lines(tmp_path / "metrics.jsonl")] == [
        (0, 0.1),
        (1, 0.2),
        (2, 0.3),
    ]


def test_a_line_cut_by_a_killed_run_is_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "time": 1.0, "rollout/reward_mean": 0.5}\n{"step": 1, "time": 2.0, "rollout/rew')

    with caplog.at_level(logging.WARNING, logger="slime.utils.metrics"):
        with MetricsLogger(tmp_path, NO_WANDB, "run") as logger:
            logger.log(1, {"rollout/reward_mean": 0.75})

    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert lines[1] == '{"step": 1, "time": 2.0, "rollout/rew'
    assert {k: v for k, v in json.loads(lines[2]).items() if k != "time"} == {"step": 1, "rollout/reward_mean": 0.75}
    assert [(r["step"], r["rollout/reward_mean"]) for r in read_metrics(path)] == [(0, 0.5), (1, 0.75)]
    assert f"{path}:2" in caplog.text


def test_non_finite_values_are_strict_json_strings_and_read_back(tmp_path):
    with MetricsLogger(tmp_path, NO_WANDB, "run") as logger:
        logger.log(0, {"train/grad_norm": float("nan"), "a": float("inf"), "b": -math.inf, "c": np.float32("nan")})

    (line,) = _raw_lines(tmp_path / "metrics.jsonl")
    assert line["train/grad_norm"] == "NaN"
    assert line["a"] == "Infinity"
    assert line["b"] == "-Infinity"
    assert line["c"] == "NaN"
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(record["train/grad_norm"]) and math.isnan(record["c"])
    assert record["a"] == math.inf and record["b"] == -math.inf


def test_tensors_and_numpy_scalars_become_python_numbers(tmp_path):
    metrics = {
        "t_float": torch.tensor(0.25),
        "t_bf16": torch.tensor(0.1, dtype=torch.bfloat16),
        "t_int": torch.tensor(7),
        "np_float": np.float32(0.1),
        "np_int": np.int64(-3),
        "np_bool": np.bool_(True),
        "py_bool": False,
    }
    with MetricsLogger(tmp_path, NO_WANDB, "run") as logger:
        logger.log(np.int64(4), metrics)

    (line,) = _raw_lines(tmp_path / "metrics.jsonl")
    expected = {
        "t_float": 0.25,
        "t_bf16": 0.10009765625,  # bf16 nearest to 0.1: 0x3DCD = 1.6015625 * 2**-4
        "t_int": 7,
        "np_float": float(np.float64(np.float32(0.1))),
        "np_int": -3,
        "np_bool": 1,
        "py_bool": 0,
    }
    assert line["step"] == 4
    for key, value in expected.items():
        assert line[key] == value and type(line[key]) is type(value), key


@pytest.mark.parametrize(
    "step, metrics, error, match",
    [
        (0, {"x": torch.tensor([1.0, 2.0])}, TypeError, r"'x'.*shape \(2,\)"),
        (0, {"x": np.zeros(1)}, TypeError, r"'x'.*shape \(1,\)"),
        (0, {"x": "0.5"}, TypeError, r"'x' must be an int or float, got str"),
        (0, {"x": None}, TypeError, r"'x' must be an int or float, got NoneType"),
        (0, {"step": 3}, ValueError, "'step' is reserved"),
        (0, {"time": 3.0}, ValueError, "'time' is reserved"),
        (-1, {"x": 1.0}, ValueError, "step must be the rollout id, >= 0; got -1"),
        (1.0, {"x": 1.0}, TypeError, "step must be the rollout id, an int; got float"),
    ],
)
def test_bad_log_calls_raise_and_write_nothing(tmp_path, step, metrics, error, match):
    with MetricsLogger(tmp_path, NO_WANDB, "run") as logger:
        with pytest.raises(error, match=match):
            logger.log(step, metrics)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_close_is_idempotent_and_log_after_close_raises(tmp_path):
    logger = MetricsLogger(tmp_path, NO_WANDB, "run")
    logger.log(0, {"rollout/reward_mean": 0.5})
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="closed"):
        logger.log(1, {"rollout/reward_mean": 0.5})
    assert len(_raw_lines(tmp_path / "metrics.jsonl")) == 1


def test_a_failed_final_plot_after_an_error_leaves_that_error(tmp_path, monkeypatch, caplog):
    """Leaving the ``with`` block on an error (a SIGTERM's SystemExit), a failure of the final plot is logged: the
    error that stopped the run is the one raised, and the JSONL is closed.  On a clean exit it is raised."""
    from slime.utils import metrics

    def broken(*args, **kwargs):
        raise AttributeError("module 'matplotlib' has no attribute 'get_data_path'")

    monkeypatch.setattr(metrics, "plot_reward_curve", broken)
    with pytest.raises(SystemExit) as stopped, caplog.at_level(logging.WARNING, logger="slime.utils.metrics"):
        with MetricsLogger(tmp_path, NO_WANDB, "run", plot_interval_s=3600) as logger:
            raise SystemExit(143)
    assert stopped.value.code == 143 and logger._file.closed
    assert "the final plot of" in caplog.text and "get_data_path" in caplog.text
    with pytest.raises(AttributeError, match="get_data_path"):
        with MetricsLogger(tmp_path / "clean", NO_WANDB, "run"):
            pass


def test_bad_plot_interval_raises(tmp_path):
    with pytest.raises(ValueError, match="plot_interval_s must be >= 0 seconds, got -1"):
        MetricsLogger(tmp_path, NO_WANDB, "run", plot_interval_s=-1)


# ---------------------------------------------------------------- reward_curve.png


def test_plot_is_a_png_redrawn_with_each_new_point(tmp_path):
    png = tmp_path / "reward_curve.png"
    with MetricsLogger(tmp_path, NO_WANDB, "run", plot_interval_s=0) as logger:
        logger.log(0, {"rollout/reward_mean": 0.2})
        one_point = _pixels(png)
        logger.log(1, {"rollout/reward_mean": 0.8})
        two_points = _pixels(png)
        logger.log(2, {"train/grad_norm": 1.0})  # neither reward nor eval: no redraw
        assert np.array_equal(_pixels(png), two_points)
    assert one_point.shape == (500, 800, 3)
    assert not np.array_equal(one_point, two_points)


def test_plot_redraws_are_throttled_but_close_draws_the_end(tmp_path):
    png = tmp_path / "reward_curve.png"
    logger = MetricsLogger(tmp_path, NO_WANDB, "run", plot_interval_s=3600)
    logger.log(0, {"rollout/reward_mean": 0.2})
    first = _pixels(png)
    logger.log(1, {"rollout/reward_mean": 0.8})
    assert np.array_equal(_pixels(png), first)
    logger.close()
    assert not np.array_equal(_pixels(png), first)


def _plot_of(run_dir, steps):
    with MetricsLogger(run_dir, NO_WANDB, "run") as logger:
        for step, metrics in steps:
            logger.log(step, metrics)
    return _pixels(run_dir / "reward_curve.png")


@pytest.mark.parametrize(
    "steps, draws_points",
    [
        ([(0, {"rollout/reward_mean": 0.3}), (1, {"rollout/reward_mean": 0.6})], True),
        ([(0, {"eval/geo3k/accuracy": 0.4}), (2, {"eval/geo3k/accuracy": 0.5, "eval/other/accuracy": 0.1})], True),
        ([(0, {"train/grad_norm": 2.0}), (1, {"rollout/reward_mean": float("nan")})], False),
    ],
    ids=["only-reward", "only-eval", "no-points"],
)
def test_plot_with_only_reward_only_eval_or_no_points(tmp_path, steps, draws_points):
    image = _plot_of(tmp_path / "run", steps)
    empty = _plot_of(tmp_path / "empty", [])
    assert image.shape == (500, 800, 3)
    assert np.array_equal(image, empty) != draws_points


def test_resumed_run_plots_its_whole_history(tmp_path):
    steps = [
        (0, {"rollout/reward_mean": 0.1, "eval/geo3k/accuracy": 0.2}),
        (1, {"rollout/reward_mean": 0.4}),
        (2, {"rollout/reward_mean": 0.5, "eval/geo3k/accuracy": 0.45}),
        (3, {"rollout/reward_mean": 0.7}),
    ]
    uninterrupted = _plot_of(tmp_path / "a", steps)
    _plot_of(tmp_path / "b", steps[:2])
    resumed = _plot_of(tmp_path / "b", steps[2:])
    second_half_only = _plot_of(tmp_path / "c", steps[2:])

    assert np.array_equal(resumed, uninterrupted)
    assert not np.array_equal(resumed, second_half_only)


def test_a_step_logged_again_after_resume_replaces_the_old_point(tmp_path):
    # killed after logging step 2, resumed from the checkpoint of step 1: step 2 is re-run
    _plot_of(tmp_path / "a", [(1, {"rollout/reward_mean": 0.2}), (2, {"rollout/reward_mean": 0.9})])
    rerun = _plot_of(tmp_path / "a", [(2, {"rollout/reward_mean": 0.4})])
    expected = _plot_of(tmp_path / "b", [(1, {"rollout/reward_mean": 0.2}), (2, {"rollout/reward_mean": 0.4})])
    assert np.array_equal(rerun, expected)


# ---------------------------------------------------------------- wandb


@pytest.mark.parametrize(
    "flag_mode, env_mode, flag_key, env_key, expected",
    [
        (None, None, None, None, "offline"),
        (None, None, "k", None, "online"),
        (None, None, None, "k", "online"),
        (None, "offline", None, "k", "offline"),
        ("offline", "online", "k", "k", "offline"),
        ("online", None, None, None, "online"),
        ("disabled", None, "k", None, "disabled"),
    ],
)
def test_resolve_wandb_mode(monkeypatch, flag_mode, env_mode, flag_key, env_key, expected):
    for name, value in (("WANDB_MODE", env_mode), ("WANDB_API_KEY", env_key)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert resolve_wandb_mode(WandbConfig(use_wandb=True, wandb_mode=flag_mode, wandb_key=flag_key)) == expected


def test_bad_wandb_mode_in_environment_raises(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "dryrun-ish")
    with pytest.raises(ConfigError, match=r"\$WANDB_MODE='dryrun-ish'.*--wandb-mode"):
        resolve_wandb_mode(WandbConfig(use_wandb=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(wandb_host="wandb.example.com"), "--wandb-host must be a URL starting with http:// or https://"),
        (dict(wandb_project=" "), "--wandb-project must be a non-empty name"),
    ],
)
def test_bad_wandb_flags_raise(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        WandbConfig(**kwargs)


class _FakeWandb(types.ModuleType):
    """Stands in for the wandb module: records init() calls and the logged points."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], []

    def Settings(self, **kwargs):  # noqa: N802 (wandb's name)
        return kwargs

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self
        return types.SimpleNamespace(
            id=kwargs["id"] or f"id{len(self.inits)}",
            name=kwargs["name"],
            log=lambda values, step: fake.logged.append((step, values)),
            finish=lambda exit_code: fake.finished.append(exit_code),
        )


def test_wandb_init_arguments_and_resume(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = WandbConfig(use_wandb=True, wandb_project="geo3k", wandb_key="secret", wandb_host="https://wb.example.com")

    with MetricsLogger(tmp_path, cfg, "grpo", config={"lr": 1e-6}) as logger:
        logger.log(3, {"rollout/reward_mean": torch.tensor(0.5), "train/grad_norm": float("nan")})
    first = fake.inits[0]
    name = first["name"]
    assert name.startswith("grpo-") and len(name) == len("grpo-") + 6 and name != "grpo"
    assert first["project"] == "geo3k" and first["group"] == "grpo" and first["config"] == {"lr": 1e-6}
    assert first["mode"] == "online" and first["dir"] == str(tmp_path)
    assert first["id"] is None and first["resume"] is None
    assert first["settings"] == {"api_key": "secret", "base_url": "https://wb.example.com"}
    step, values = fake.logged[0]
    assert step == 3 and values["rollout/reward_mean"] == 0.5 and type(values["rollout/reward_mean"]) is float
    assert math.isnan(values["train/grad_norm"])
    assert json.loads((tmp_path / "wandb_run.json").read_text()) == {"id": "id1", "name": name}

    with pytest.raises(KeyError):
        with MetricsLogger(tmp_path, cfg, "grpo") as logger:
            raise KeyError("crash")
    resumed = fake.inits[1]
    assert resumed["id"] == "id1" and resumed["name"] == name and resumed["resume"] == "allow"
    assert fake.finished == [0, 1]


def test_wandb_exact_name_and_disabled_mode(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    with MetricsLogger(tmp_path / "a", WandbConfig(use_wandb=True, disable_wandb_random_suffix=True), "grpo"):
        pass
    assert fake.inits[0]["name"] == "grpo" and fake.inits[0]["mode"] == "offline"
    assert fake.inits[0]["settings"] == {}

    with MetricsLogger(tmp_path / "b", WandbConfig(use_wandb=True, wandb_mode="disabled"), "grpo") as logger:
        logger.log(0, {"x": 1.0})
    assert len(fake.inits) == 1 and not (tmp_path / "b" / "wandb_run.json").exists()


def test_malformed_wandb_run_file_raises(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb())
    (tmp_path / "wandb_run.json").write_text('{"id": "abc"}')
    with pytest.raises(ValueError, match=r"wandb_run.json is malformed.*Delete it"):
        MetricsLogger(tmp_path, WandbConfig(use_wandb=True, wandb_mode="offline"), "grpo")


def _wandb_records(path):
    """Parse a ``.wandb`` transaction log into ``wandb_internal_pb2.Record`` messages.

    Format (wandb's LevelDB-style log): a 7-byte file header (b":W&B", magic 0xBEE1,
    version 0), then 32 KiB blocks of chunks, each with a 7-byte header (crc32c, little-endian
    uint16 length, type 1 full / 2 first / 3 middle / 4 last).  A block's tail shorter
    than a chunk header is padding.  CRCs are not checked.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(records):
    """{step: {key: value}} from the history records, without wandb's own ``_`` keys."""
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def test_wandb_offline_run_holds_the_logged_metrics_and_resumes(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    run_dir = tmp_path / "run"
    cfg = WandbConfig(use_wandb=True, wandb_project="geo3k", disable_wandb_random_suffix=True)

    with MetricsLogger(run_dir, cfg, "grpo-test", config={"lr": 1e-6}) as logger:
        logger.log(0, {"rollout/reward_mean": 0.25, "train/grad_norm": float("nan")})
        logger.log(1, {"rollout/reward_mean": torch.tensor(0.5), "eval/geo3k/accuracy": 0.375})
    with MetricsLogger(run_dir, cfg, "grpo-test") as logger:
        logger.log(2, {"rollout/reward_mean": 0.75})

    first_dir, second_dir = sorted((run_dir / "wandb").glob("offline-run-*"))
    run_id = json.loads((run_dir / "wandb_run.json").read_text())["id"]
    assert [p.name for p in first_dir.glob("*.wandb")] == [f"run-{run_id}.wandb"]
    assert [p.name for p in second_dir.glob("*.wandb")] == [f"run-{run_id}.wandb"]

    records = _wandb_records(first_dir / f"run-{run_id}.wandb")
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "grpo-test" and run.project == "geo3k" and run.run_group == "grpo-test"
    assert {item.key: json.loads(item.value_json) for item in run.config.update}.get("lr") == 1e-6
    history = _wandb_history(records)
    assert history.keys() == {0, 1}
    assert history[0]["rollout/reward_mean"] == 0.25 and math.isnan(history[0]["train/grad_norm"])
    assert history[1] == {"rollout/reward_mean": 0.5, "eval/geo3k/accuracy": 0.375}

    # wandb's service process may still be appending to the resumed run's file right after
    # finish() returns on a loaded machine: poll (bounded) before judging its contents.
    second_file = second_dir / f"run-{run_id}.wandb"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if _wandb_history(_wandb_records(second_file)):
                break
        except Exception:  # a record still being written
            pass
        time.sleep(0.5)
    assert _wandb_history(_wandb_records(second_file)) == {2: {"rollout/reward_mean": 0.75}}


# ---------------------------------------------------------------- progress


def test_progress_prints_one_readable_line_per_step_when_not_a_tty():
    out = io.StringIO()
    with RolloutProgress(total=5, initial=2, file=out) as bar:
        bar.update({"rollout/reward_mean": 0.5, "train/loss": 1.0})
        bar.update({"rollout/reward_mean": torch.tensor(0.25), "eval/geo3k/accuracy": 0.375})
        bar.update({"rollout/reward_mean": 0.75})

    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("rollout: 3/5 (60%)") and lines[0].endswith("reward=0.500]")
    assert lines[1].startswith("rollout: 4/5 (80%)") and lines[1].endswith("reward=0.250, eval/geo3k=0.375]")
    assert lines[2].startswith("rollout: 5/5 (100%)") and lines[2].endswith("reward=0.750, eval/geo3k=0.375]")


def test_progress_on_a_tty_is_a_tqdm_bar():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    with RolloutProgress(total=4, file=out) as bar:
        bar.update({"rollout/reward_mean": 0.5})
    text = out.getvalue()
    assert "\r" in text and "1/4" in text and "reward=0.500" in text


def test_disabled_progress_prints_nothing():
    out = io.StringIO()
    with RolloutProgress(total=4, disable=True, file=out) as bar:
        bar.update({"rollout/reward_mean": 0.5})
    assert out.getvalue() == ""


def test_progress_initial_beyond_total_raises():
    with pytest.raises(ValueError, match="initial=5, total=4"):
        RolloutProgress(total=4, initial=5)


def test_plot_ticks_whole_steps_and_keeps_overlapping_eval_points_visible():
    records = [{"step": 0, "rollout/reward_mean": 0.25, "eval/geo3k/accuracy": 0.25},
               {"step": 1, "rollout/reward_mean": 0.5}, {"step": 2, "rollout/reward_mean": 0.75}]
    fig = reward_curve_figure(records)
    fig.canvas.draw()
    ax = fig.axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    reward, evaluation = ax.get_lines()
    assert (reward.get_label(), evaluation.get_label()) == ("train reward", "eval geo3k accuracy")
    assert list(evaluation.get_xydata()[0]) == list(reward.get_xydata()[0]) == [0.0, 0.25]  # same point...
    assert evaluation.get_marker() != reward.get_marker() and evaluation.get_markersize() > reward.get_markersize()
    assert evaluation.get_markerfacecolor() == "none"  # ...drawn hollow and larger, so the dot shows through
    # Series order (so colours) does not depend on which was logged first, e.g. after a resume.
    eval_first = reward_curve_figure([{"step": 3, "eval/geo3k/accuracy": 0.5}, {"step": 3, "rollout/reward_mean": 0.1}])
    assert [line.get_label() for line in eval_first.axes[0].get_lines()] == ["train reward", "eval geo3k accuracy"]
    assert eval_first.axes[0].get_lines()[0].get_color() == reward.get_color()
