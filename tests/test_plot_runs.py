"""``python -m slime.utils.plot_runs``: several runs' reward curves in one PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime.utils.plot_runs import load_runs, runs_figure

REPO = Path(__file__).resolve().parents[1]


def _run(folder: Path, rewards: list[float], evals: dict[int, float] | None = None) -> Path:
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, reward in enumerate(rewards):
            f.write(json.dumps({"step": step, "time": 0.0, "rollout/reward_mean": reward, "train/loss": 1.0}) + "\n")
        for step, accuracy in (evals or {}).items():
            f.write(json.dumps({"step": step, "time": 0.0, "eval/geo3k/accuracy": accuracy}) + "\n")
    return folder


def test_the_png_holds_one_colour_per_run_with_its_reward_and_eval(tmp_path):
    a = _run(tmp_path / "fsdp", [0.3, 0.6, 0.9], evals={0: 0.2, 3: 0.8})
    b = _run(tmp_path / "megatron", [0.3, 0.7, 1.0])
    out = tmp_path / "plots" / "overlay.png"
    subprocess.run([sys.executable, "-m", "slime.utils.plot_runs", str(a), str(b / "metrics.jsonl"), "-o", str(out),
                    "--labels", "FSDP", "Megatron"], check=True, cwd=REPO)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = load_runs([str(a), str(b)], ["FSDP", "Megatron"])
    fig = runs_figure(runs)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"FSDP: train reward", "FSDP: eval geo3k accuracy", "Megatron: train reward"}
    assert list(lines["Megatron: train reward"].get_ydata()) == [0.3, 0.7, 1.0]
    assert list(lines["FSDP: eval geo3k accuracy"].get_xdata()) == [0, 3]
    assert lines["FSDP: train reward"].get_color() == lines["FSDP: eval geo3k accuracy"].get_color()
    assert lines["FSDP: train reward"].get_color() != lines["Megatron: train reward"].get_color()


def test_labels_default_to_folder_names_and_bad_runs_are_named(tmp_path):
    a = _run(tmp_path / "run-a", [0.1])
    assert list(load_runs([str(a)])) == ["run-a"]
    with pytest.raises(ValueError, match="nowhere: no metrics.jsonl"):
        load_runs([str(tmp_path / "nowhere")])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 0, "train/loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="holds no rollout/reward_mean"):
        load_runs([str(empty)])
    with pytest.raises(ValueError, match="2 names for 1 runs"):
        load_runs([str(a)], ["x", "y"])
    proc = subprocess.run([sys.executable, "-m", "slime.utils.plot_runs", str(empty), "-o", str(tmp_path / "x.png")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "holds no rollout/reward_mean" in proc.stderr
