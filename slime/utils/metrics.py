"""Run observability: metrics JSONL, wandb, the reward-curve plot and the progress bar.

The driver owns one :class:`MetricsLogger` per run; other processes return their metrics to it.  Keys
are namespaced with ``/`` (``rollout/reward_mean``, ``train/grad_norm``, ``eval/geo3k/accuracy``,
``perf/rollout_time_s``).  Files in ``--output-dir``:

- ``metrics.jsonl``: one JSON object per ``log`` call, ``{"step": <rollout id>, "time": <unix s>, <key>:
  <value>, ...}``, flushed per line; non-finite values as the strings ``"NaN"``, ``"Infinity"``,
  ``"-Infinity"`` (strict JSON; :func:`read_metrics` turns them back);
- ``reward_curve.png``: train reward and each ``eval/<name>/accuracy`` against the step, redrawn from
  ``metrics.jsonl`` (a resumed run shows its whole history);
- ``wandb_run.json`` and ``wandb/`` (``--use-wandb``): the wandb run id and name, re-used on resume.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import re
import secrets
import sys
import time
from pathlib import Path
from typing import IO, Any, Callable

from tqdm import tqdm

from slime.utils.config import ConfigError
from slime.utils.metrics_config import WANDB_MODES, WandbConfig

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_curve.png"
WANDB_RUN_FILE = "wandb_run.json"
REWARD_KEY = "rollout/reward_mean"
EVAL_ACCURACY_KEY = re.compile(r"^eval/(.+)/accuracy$")
"""Matches ``eval/<name>/accuracy``; group 1 is the eval set's name."""

_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _to_scalar(key: str, value: Any) -> int | float:
    """``value`` as a Python ``int`` or ``float`` (0-d tensors and numpy scalars via ``.item()``).

    Raises:
        TypeError: ``value`` is not a number, or is a tensor / array with dimensions.
    """
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        if getattr(value, "ndim", 0) != 0:
            raise TypeError(
                f"metric {key!r} must be a scalar, got a {type(value).__name__} of shape "
                f"{tuple(value.shape)}; reduce it first (e.g. .mean())"
            )
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    raise TypeError(f"metric {key!r} must be an int or float, got {type(value).__name__} {value!r}")


def json_value(value: Any) -> Any:
    """``value`` for strict JSON (``allow_nan=False``): a non-finite float as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"`` (what :func:`read_metrics` turns back into floats), anything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` in file order, non-finite strings as floats; ``[]`` without the file.

    A line that is not a JSON object with an integer ``"step"`` (a write cut by a kill) is skipped with a
    warning naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                logger.warning("%s:%d: skipping a line that is not valid JSON (%s)", path, line_no, e)
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                logger.warning("%s:%d: skipping a line without an integer 'step'", path, line_no)
                continue
            for key, value in record.items():
                if isinstance(value, str) and value in _NON_FINITE:
                    record[key] = _NON_FINITE[value]
            records.append(record)
    return records


def truncate_metrics(path: str | os.PathLike, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite ``path`` (atomically) with only the records where ``keep(record)``; returns how many were dropped."""
    path = Path(path)
    records = read_metrics(path)
    kept = [r for r in records if keep(r)]
    if len(kept) == len(records) and path.exists():
        return 0
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in kept:
            f.write(json.dumps({k: json_value(v) for k, v in record.items()}, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return len(records) - len(kept)


def plot_reward_curve(records: list[dict[str, Any]], path: str | os.PathLike, title: str = "") -> None:
    """Write :func:`reward_curve_figure` of ``records`` to the PNG ``path`` (replaced atomically)."""
    fig = reward_curve_figure(records, title)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def reward_series(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """The plotted series, ``{label: {step: value}}``: ``"train reward"`` and ``"eval <name> accuracy"``.

    A later record of a step wins (a resumed run); non-finite values are left out.
    """
    series: dict[str, dict[int, float]] = {}
    for record in records:
        for key, value in record.items():
            match = EVAL_ACCURACY_KEY.match(key)
            if key == REWARD_KEY:
                label = "train reward"
            elif match:
                label = f"eval {match[1]} accuracy"
            else:
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(label, {})[record["step"]] = value
    return series


def reward_curve_figure(records: list[dict[str, Any]], title: str = ""):
    """The reward / accuracy figure of :func:`reward_series` (a ``matplotlib.figure.Figure``, Agg canvas), not saved.

    y in [0, 1] plus a margin; the train reward has dots, each eval accuracy a dashed line with hollow
    squares, so that equal points stay visible.
    """
    from matplotlib.figure import Figure  # Agg canvas, without touching pyplot's global backend
    from matplotlib.ticker import MaxNLocator

    series = reward_series(records)
    fig = Figure(figsize=(8, 5), dpi=100)
    ax = fig.add_subplot()
    # Train reward first, evals by name: the same colour per series in every redraw and after a resume.
    for label, points in sorted(series.items(), key=lambda item: (item[0] != "train reward", item[0])):
        steps = sorted(points)
        style = dict(marker="o", markersize=3) if label == "train reward" else dict(
            marker="s", markersize=7, markerfacecolor="none", linestyle="--"
        )
        ax.plot(steps, [points[s] for s in steps], label=label, **style)
    if series:
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, "no reward or eval accuracy logged yet", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"{title}: reward and eval accuracy" if title else "Reward and eval accuracy")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("reward / accuracy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(-0.03, 1.03)  # points at exactly 0 or 1 stay whole
    ax.grid(alpha=0.3)
    return fig


def resolve_wandb_mode(cfg: WandbConfig) -> str:
    """``--wandb-mode``, else ``$WANDB_MODE``, else ``"online"`` with an API key (flag or env), else ``"offline"``.

    Keys stored by ``wandb login`` (``~/.netrc``) are not looked at.

    Raises:
        ConfigError: ``$WANDB_MODE`` is not online/offline/disabled.
    """
    if cfg.wandb_mode is not None:
        return cfg.wandb_mode
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode:
        if env_mode not in WANDB_MODES:
            raise ConfigError(
                f"$WANDB_MODE={env_mode!r} is not one of {', '.join(WANDB_MODES)}; "
                "unset it or pass --wandb-mode"
            )
        return env_mode
    return "online" if cfg.wandb_key or os.environ.get("WANDB_API_KEY") else "offline"


def _init_wandb(run_dir: Path, cfg: WandbConfig, run_name: str, config: dict | None) -> Any:
    """Start (or resume) the wandb run of ``run_dir``; None when the mode is ``disabled``.

    Raises:
        ValueError: ``run_dir/wandb_run.json`` exists but is malformed.
    """
    mode = resolve_wandb_mode(cfg)
    if mode == "disabled":
        return None
    import wandb

    saved_path = run_dir / WANDB_RUN_FILE
    if saved_path.exists():
        try:
            saved = json.loads(saved_path.read_text())
            run_id, name = str(saved["id"]), str(saved["name"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{saved_path} is malformed ({e!r}); it should be {{\"id\": ..., \"name\": ...}}. "
                "Delete it to start a new wandb run."
            ) from None
        resume = "allow"
    else:
        run_id, resume = None, None
        name = run_name if cfg.disable_wandb_random_suffix else f"{run_name}-{secrets.token_hex(3)}"
    settings = {}
    if cfg.wandb_key:
        settings["api_key"] = cfg.wandb_key
    if cfg.wandb_host:
        settings["base_url"] = cfg.wandb_host
    run = wandb.init(
        project=cfg.wandb_project,
        group=cfg.wandb_group or run_name,
        name=name,
        config=config,
        allow_val_change=resume is not None,
        dir=str(run_dir),
        mode=mode,
        id=run_id,
        resume=resume,
        reinit="create_new",  # this run object only; leaves wandb.run and other runs alone
        settings=wandb.Settings(**settings),
    )
    tmp = saved_path.with_name(f".{saved_path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"id": run.id, "name": run.name}) + "\n")
    os.replace(tmp, saved_path)
    return run


class MetricsLogger:
    """Writes each step's metrics to ``metrics.jsonl``, wandb (``step=<rollout id>``) and ``reward_curve.png``.

    The plot is redrawn by a ``log`` with a reward or eval accuracy, at most every ``plot_interval_s``
    seconds, and on ``close()``.  A context manager; ``close()`` is idempotent.  ``config`` (the run's
    flags) is the wandb run config; ``run_name`` is the plot title, wandb run name and default group.
    wandb may reject steps re-logged after a resume from an older checkpoint; the JSONL keeps them.

    Raises:
        ValueError: ``plot_interval_s`` < 0, or ``run_dir/wandb_run.json`` is malformed.
        ConfigError: ``$WANDB_MODE`` is invalid.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        wandb_cfg: WandbConfig,
        run_name: str,
        config: dict | None = None,
        *,
        plot_interval_s: float = 10.0,
    ):
        if plot_interval_s < 0:
            raise ValueError(f"plot_interval_s must be >= 0 seconds, got {plot_interval_s}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.plot_path = self.run_dir / PLOT_FILE
        self.run_name = run_name
        self.plot_interval_s = plot_interval_s
        self._last_plot = -math.inf
        self._closed = False
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        self._end_partial_line()
        try:
            self._wandb_run = _init_wandb(self.run_dir, wandb_cfg, run_name, config) if wandb_cfg.use_wandb else None
        except BaseException:
            self._file.close()
            raise

    def _end_partial_line(self) -> None:
        if self._file.tell() == 0:
            return
        with open(self.metrics_path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
        logger.warning("%s: the last line is incomplete (killed run?); appending after it", self.metrics_path)
        self._file.write("\n")
        self._file.flush()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record the metrics of rollout step ``step`` (ints, floats, numpy scalars, 0-d tensors: ``.item()`` syncs).

        Raises:
            RuntimeError: the logger is closed.
            ValueError: ``step`` is negative, or a key is ``"step"`` / ``"time"``.
            TypeError: ``step`` is not an int, or a value is not a scalar number.
        """
        if self._closed:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
        try:
            step = operator.index(step)
        except TypeError:
            raise TypeError(f"step must be the rollout id, an int; got {type(step).__name__} {step!r}") from None
        if step < 0:
            raise ValueError(f"step must be the rollout id, >= 0; got {step}")
        values = {key: _to_scalar(key, value) for key, value in metrics.items()}
        for reserved in ("step", "time"):
            if reserved in values:
                raise ValueError(f"metric key {reserved!r} is reserved for the record itself; rename the metric")
        record = {"step": step, "time": time.time(), **{k: json_value(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        plotted = any(key == REWARD_KEY or EVAL_ACCURACY_KEY.match(key) for key in values)
        if plotted and time.monotonic() - self._last_plot >= self.plot_interval_s:
            self.plot()

    def plot(self) -> None:
        """Redraw ``reward_curve.png`` from the whole ``metrics.jsonl``."""
        plot_reward_curve(read_metrics(self.metrics_path), self.plot_path, title=self.run_name)
        self._last_plot = time.monotonic()

    def close(self, exit_code: int = 0) -> None:
        """Draw the final plot, close the JSONL and finish the wandb run (non-zero ``exit_code``: failed); idempotent.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.plot()
        finally:
            self._file.close()
            if self._wandb_run is not None:
                self._wandb_run.finish(exit_code=exit_code)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close(exit_code=1)
        except Exception as e:  # noqa: BLE001 - the error that ended the run is the one raised
            # e.g. a SIGTERM (SystemExit) that interrupted the step's plot half-way through importing matplotlib,
            # which then fails to import again here
            logger.warning("the final plot of %s failed after the run stopped: %s", self.plot_path, e)


class RolloutProgress:
    """Progress over rollout steps with the latest train reward and eval accuracies.

    A tqdm bar on a terminal; elsewhere (a log file, a pipe) one plain line per step.  The rate counts
    this process's steps only.  ``initial``: steps already done; ``disable``: show nothing.

    Raises:
        ValueError: not ``0 <= initial <= total``.
    """

    _LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def __init__(self, total: int, initial: int = 0, disable: bool = False, file: IO[str] | None = None):
        if not 0 <= initial <= total:
            raise ValueError(f"progress needs 0 <= initial <= total, got initial={initial}, total={total}")
        self.total, self.initial, self.n = total, initial, initial
        self.disable = disable
        self.file = file if file is not None else sys.stderr
        self.postfix: dict[str, str] = {}
        self._start = time.monotonic()
        isatty = getattr(self.file, "isatty", None)
        self._bar = None
        if not disable and isatty is not None and isatty():
            self._bar = tqdm(total=total, initial=initial, desc="rollout", unit="step", file=self.file, dynamic_ncols=True)

    def update(self, metrics: dict[str, Any]) -> None:
        """Advance one step; show ``metrics``' reward and eval accuracies (which stay until the next eval)."""
        self.n += 1
        for key, value in metrics.items():
            match = EVAL_ACCURACY_KEY.match(key)
            if key == REWARD_KEY:
                self.postfix["reward"] = f"{float(value):.3f}"
            elif match:
                self.postfix[f"eval/{match[1]}"] = f"{float(value):.3f}"
        if self.disable:
            return
        if self._bar is not None:
            self._bar.set_postfix(self.postfix, refresh=False)
            self._bar.update(1)
            return
        line = tqdm.format_meter(
            self.n,
            self.total,
            time.monotonic() - self._start,
            prefix="rollout",
            unit="step",
            initial=self.initial,
            postfix=", ".join(f"{k}={v}" for k, v in self.postfix.items()),
            bar_format=self._LINE_FORMAT,
        )
        print(line, file=self.file, flush=True)

    def close(self) -> None:
        """Close the tqdm bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> RolloutProgress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def progress(total: int, initial: int = 0, disable: bool = False) -> RolloutProgress:
    """A :class:`RolloutProgress` on stderr: ``with progress(num_rollout, start, disable) as bar: bar.update(metrics)``.

    Raises:
        ValueError: not ``0 <= initial <= total``.
    """
    return RolloutProgress(total, initial, disable)
