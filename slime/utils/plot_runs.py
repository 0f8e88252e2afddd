"""Overlay the reward curves of several runs in one PNG: ``python -m slime.utils.plot_runs RUN... -o out.png``.

Each ``RUN`` is a run folder (``--output-dir``) or its ``metrics.jsonl``.  Each run gets one colour and
marker: its train reward solid, each eval accuracy dashed with hollow squares (the series of
:func:`slime.utils.metrics.reward_series`), against the rollout step; earlier runs are drawn wider and
lighter.  E.g. ``docs/results/fsdp_vs_megatron.png``::

    python -m slime.utils.plot_runs runs/fsdp runs/megatron --labels FSDP Megatron \\
        -o docs/results/fsdp_vs_megatron.png --title "colour task, same seed and flags"
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Mapping, Sequence

from slime.utils.metrics import METRICS_FILE, read_metrics, reward_series


def metrics_path(run: str | os.PathLike) -> Path:
    """The ``metrics.jsonl`` of a run folder, or the file itself."""
    path = Path(run)
    return path / METRICS_FILE if path.is_dir() else path


def load_runs(runs: Sequence[str], labels: Sequence[str] | None = None) -> dict[str, dict[str, dict[int, float]]]:
    """``{label: reward_series(records)}`` for each run, in order.

    Raises:
        ValueError: a run without ``metrics.jsonl`` or without any reward / accuracy in it, labels that do
            not match the runs one to one, or two runs with the same label (each message names the run).
    """
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"--labels gives {len(labels)} names for {len(runs)} runs; give one per run")
    out: dict[str, dict[str, dict[int, float]]] = {}
    for i, run in enumerate(runs):
        path = metrics_path(run)
        if not path.is_file():
            raise ValueError(f"{run}: no {METRICS_FILE} (give a run's --output-dir or its metrics file)")
        series = reward_series(read_metrics(path))
        if not series:
            raise ValueError(f"{run}: {path} holds no rollout/reward_mean or eval/<name>/accuracy value")
        label = labels[i] if labels is not None else (path.parent.name if path.name == METRICS_FILE else path.stem)
        if label in out:
            raise ValueError(f"two runs are labelled {label!r}; name them with --labels")
        out[label] = series
    return out


def runs_figure(runs: Mapping[str, Mapping[str, Mapping[int, float]]], title: str = ""):
    """The overlay figure (a ``matplotlib.figure.Figure``, Agg canvas), not saved."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.add_subplot()
    markers = ("o", "x", "^", "d", "v", "+")
    for i, (run, series) in enumerate(runs.items()):
        # Earlier runs are drawn wider and lighter, so identical curves stay visible one over the other.
        later = len(runs) - 1 - i
        width, alpha = 1.5 + 3.5 * later / max(1, len(runs) - 1), 0.45 if later else 1.0
        for label, points in sorted(series.items(), key=lambda item: (item[0] != "train reward", item[0])):
            steps = sorted(points)
            style = dict(marker=markers[i % len(markers)], markersize=6) if label == "train reward" else dict(
                marker="s", markersize=8, markerfacecolor="none", linestyle="--")
            ax.plot(steps, [points[s] for s in steps], color=f"C{i % 10}", linewidth=width, alpha=alpha,
                    label=f"{run}: {label}", **style)
    ax.legend(loc="best")
    ax.set_title(title or "Reward and eval accuracy")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("reward / accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slime.utils.plot_runs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="Run folders (holding metrics.jsonl) or metrics.jsonl files.")
    parser.add_argument("-o", "--output", required=True, help="The PNG to write.")
    parser.add_argument("--labels", nargs="+", default=None, help="One name per run (default: folder names).")
    parser.add_argument("--title", default="", help="Figure title.")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.runs, args.labels)
    except ValueError as e:
        parser.error(str(e))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_figure(runs, args.title).savefig(out, format="png")
    steps = {run: len(series.get("train reward", {})) for run, series in runs.items()}
    print(f"{out}: " + ", ".join(f"{run} ({n} rollouts)" for run, n in steps.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
