"""The training step's metrics: how a backend's ranks reduce (:class:`DataParallel`), the loss terms of an optimizer
step and their mean over the step's optimizer steps, and the train-vs-rollout mismatch monitor.

Loss terms computed with the step's global normaliser are each rank's share, so a step's value is a sum over
micro-batches and ranks (:meth:`DataParallel.sum`).  Metrics named ``*_min`` / ``*_max`` (the IS weight's) are
extremes, reduced by min / max over micro-batches, ranks and steps instead.  The monitor (:func:`mismatch_monitor`),
over loss-masked response tokens of all ranks, with ``d = log p_train(y_t) - log p_rollout(y_t)``:
``train/logprob_abs_diff`` the mean ``|d|`` (upstream's ``train_rollout_logprob_abs_diff``), ``train/logprob_k3_kl``
the mean ``exp(d) - 1 - d`` (Schulman's k3 estimator of KL(rollout || trainer), "Approximating KL divergence", 2020),
``train/logprob_ratio_off_frac`` the share with ``|exp(d) - 1| > 0.2``; each also by prompt kind (``_image``,
``_text``: a vision-tower mismatch shows only in the first).  Tokens after a generated image / video placeholder are
left out and counted in ``train/logprob_gap_altered_tokens`` (``docs/design/training_step.md``).
``train/router_agreement`` is the share of (position, MoE layer) pairs whose trainer top-k set equals the engine's
(:mod:`slime.routing_replay`, ``docs/design/routing_replay.md``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from slime.data.sample import Sample
from slime.errors import SlimeError

logger = logging.getLogger(__name__)

_GAP_KINDS = ("image", "text")
RATIO_OFF = 0.2
"""``train/logprob_ratio_off_frac`` counts tokens whose ratio ``exp(d)`` is outside ``[1 - RATIO_OFF, 1 + RATIO_OFF]``
(PPO's usual clip range)."""
_GAP_SUMS = ("abs_diff", "k3", "ratio_off", "tokens")


class LogprobGapError(SlimeError, RuntimeError):
    """A step's trainer-vs-rollout log-prob gap passed ``--ci-train-rollout-logprob-abs-diff-threshold``."""


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """How a backend's ranks reduce, as one value: this rank's data-parallel ``rank`` of ``size``, the data-parallel
    ``group`` for CPU tensors (micro-batch counts, loss normalisers; None: the whole world), ``copies``, how many
    ranks of the world hold each loss term (Megatron: the TP size, whose ranks of the last pipeline stage compute the
    same loss; 1 for FSDP), and whether this rank ``computes_loss`` (Megatron: the last pipeline stage's ranks; the
    others add zeros to every :meth:`sum` of loss sums)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    copies: int = 1
    computes_loss: bool = True

    def sum(self, values: Mapping[str, float | Tensor]) -> dict[str, float]:
        """Per-rank loss terms or metric sums (the same keys on every rank; zeros where a rank computes no loss)
        summed over the world and divided by :attr:`copies`. Collective."""
        summed = all_reduce_sums(values)
        return summed if self.copies == 1 else {k: v / self.copies for k, v in summed.items()}


def all_reduce_sums(values: Mapping[str, float | Tensor], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Sum scalar values (numbers or 0-d tensors on any device) over the ranks of ``group`` (collective, float64 on CPU;
    ``group`` must take CPU tensors); every rank passes the same keys.  Returns name -> float in sorted order, the
    values unchanged without ``torch.distributed``."""
    keys = sorted(values)
    local = torch.tensor(
        [float(values[k].detach().double().cpu()) if isinstance(values[k], Tensor) else float(values[k]) for k in keys],
        dtype=torch.float64,
    )
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local, group=group)
    return dict(zip(keys, local.tolist()))


EXTREMA = ("_min", "_max")
"""Suffixes of the metrics reduced as extremes rather than summed and averaged."""


def neutral_extremum(name: str) -> float:
    """``inf`` for a ``*_min`` metric, ``-inf`` for a ``*_max`` one: what a micro-batch or rank without tokens gives."""
    return math.inf if name.endswith("_min") else -math.inf


def fold_extremum(name: str, current: float, value: float) -> float:
    """``min`` or ``max`` (by ``name``'s suffix) of two values of one extreme metric."""
    return min(current, value) if name.endswith("_min") else max(current, value)


def all_reduce_extrema(values: Mapping[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Per-rank extremes (``*_min`` / ``*_max`` floats) reduced over the ranks of ``group`` (collective, float64 on CPU;
    every rank passes the same keys); ``inf`` / ``-inf`` where no rank had a token."""
    keys = sorted(values)
    signs = torch.tensor([-1.0 if k.endswith("_min") else 1.0 for k in keys], dtype=torch.float64)
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64) * signs
    if keys and dist.is_available() and dist.is_initialized():
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, (local * signs).tolist()))


def extrema_over_steps(per_step: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each extreme metric's min / max over the optimizer steps, over its finite values (omitted without any)."""
    out = {}
    for name, values in per_step.items():
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            out[name] = min(finite) if name.endswith("_min") else max(finite)
    return out


def logprob_gap_sums(
    samples: Sequence[Sample], train_log_probs: Sequence[Tensor], placeholder_ids: Collection[int] = ()
) -> dict[str, float]:
    """This rank's sums for the log-prob gap (module docstring): ``gap/<kind>/abs_diff`` (nats), ``gap/<kind>/tokens``
    (``kind``: ``image`` when the prompt has images, else ``text``) and ``gap/altered/tokens``, always all present.
    Samples without ``rollout_log_probs`` are left out (logged); ``train_log_probs`` holds one float ``[R]`` per sample;
    ``placeholder_ids`` are the response ids the trainer does not feed as the engine did.

    Raises:
        ValueError: the lists differ in length, or a sample's tensors differ from its R.
    """
    if len(samples) != len(train_log_probs):
        raise ValueError(f"{len(samples)} samples but {len(train_log_probs)} log-prob tensors")
    sums = {f"gap/{kind}/{what}": 0.0 for kind in _GAP_KINDS for what in _GAP_SUMS}
    sums["gap/altered/tokens"] = 0.0
    missing = [s.index for s in samples if not s.rollout_log_probs]
    if missing:
        logger.warning(
            "%d sample(s) have no rollout_log_probs (first: sample %d); they are left out of train/logprob_abs_diff",
            len(missing),
            missing[0],
        )
    for sample, train_lp in zip(samples, train_log_probs):
        if not sample.rollout_log_probs:
            continue
        r = sample.response_length
        if train_lp.shape != (r,) or len(sample.loss_mask) != r or len(sample.rollout_log_probs) != r:
            raise ValueError(
                f"sample {sample.index}: response has {r} tokens but train log-probs {tuple(train_lp.shape)}, "
                f"loss_mask {len(sample.loss_mask)}, rollout_log_probs {len(sample.rollout_log_probs)}"
            )
        mask = torch.as_tensor(sample.loss_mask, dtype=torch.bool)
        first = next((t for t, token in enumerate(sample.response_token_ids) if token in placeholder_ids), None)
        if first is not None:
            sums["gap/altered/tokens"] += float(mask[first + 1 :].sum())
            mask[first + 1 :] = False
        d = (train_lp.detach().double().cpu() - torch.as_tensor(sample.rollout_log_probs, dtype=torch.float64))[mask]
        kind = "image" if sample.has_images else "text"
        sums[f"gap/{kind}/abs_diff"] += float(d.abs().sum())
        sums[f"gap/{kind}/k3"] += float((torch.expm1(d) - d).sum())
        sums[f"gap/{kind}/ratio_off"] += float((torch.expm1(d).abs() > RATIO_OFF).sum())
        sums[f"gap/{kind}/tokens"] += float(mask.sum())
    return sums


def logprob_gap_metrics(summed: Mapping[str, float]) -> dict[str, float]:
    """All-reduced :func:`logprob_gap_sums` (and :func:`route_agreement_sums`, when given) ->
    ``train/logprob_{abs_diff,k3_kl,ratio_off_frac}[_image|_text]``, ``train/router_agreement[_image|_text]`` and
    ``train/logprob_gap_altered_tokens``; a split without tokens (pairs) is omitted, so is the overall value without
    any; ``train/router_agreement_skipped`` (samples with malformed engine routes) where routes were compared or
    skipped."""
    metrics = {"train/logprob_gap_altered_tokens": summed.get("gap/altered/tokens", 0.0)}
    names = {"abs_diff": "logprob_abs_diff", "k3": "logprob_k3_kl", "ratio_off": "logprob_ratio_off_frac"}
    _split_means(metrics, summed, "gap", "tokens", names)
    if "routes/text/pairs" in summed:
        _split_means(metrics, summed, "routes", "pairs", {"agree": "router_agreement"})
        if "train/router_agreement" in metrics or summed.get("routes/skipped", 0.0) > 0:
            metrics["train/router_agreement_skipped"] = summed.get("routes/skipped", 0.0)
    return metrics


def _split_means(metrics: dict[str, float], summed: Mapping[str, float], prefix: str, count: str,
                 names: Mapping[str, str]) -> None:
    """``train/<name>_<kind>`` = ``<prefix>/<kind>/<sum> / <prefix>/<kind>/<count>`` and the overall
    ``train/<name>``, into ``metrics``; kinds (and the overall value) without a count are omitted."""
    totals = {what: 0.0 for what in [*names, count]}
    for kind in _GAP_KINDS:
        n = summed[f"{prefix}/{kind}/{count}"]
        for what, name in names.items():
            if n > 0:
                metrics[f"train/{name}_{kind}"] = summed[f"{prefix}/{kind}/{what}"] / n
            totals[what] += summed[f"{prefix}/{kind}/{what}"]
        totals[count] += n
    if totals[count] > 0:
        for what, name in names.items():
            metrics[f"train/{name}"] = totals[what] / totals[count]


def check_gap_threshold(metrics: Mapping[str, float], threshold: float | None, rollout_id: int) -> None:
    """Stop the run when a prompt kind's mean gap passes ``threshold``
    (``--ci-train-rollout-logprob-abs-diff-threshold``; None: no bound).

    Raises:
        LogprobGapError: naming the rollout step, the split(s), the gaps and the bound.
    """
    if threshold is None:
        return
    over = [f"{kind} prompts {metrics[f'train/logprob_abs_diff_{kind}']:.4g}" for kind in _GAP_KINDS
            if metrics.get(f"train/logprob_abs_diff_{kind}", 0.0) > threshold]
    if over:
        raise LogprobGapError(
            f"rollout step {rollout_id}: the mean |trainer - rollout log-prob| passed "
            f"--ci-train-rollout-logprob-abs-diff-threshold {threshold:g} nats ({', '.join(over)}); no update was "
            "applied. A large gap from step 0 on points at the weight sync or the engine (another dtype, weights or "
            "temperature); one that creeps up over a run at MoE routing drift (--use-rollout-routing-replay)"
        )


def step_loss_metrics(values: Sequence[Mapping[str, Tensor]], terms: Sequence[str], extremes: Sequence[str],
                      dp: DataParallel) -> dict[str, float]:
    """One optimizer step's ``train/<term>`` (summed over micro-batches and ranks) and ``train/<extreme>`` (min / max
    over them) from this rank's per-micro-batch 0-d shares ``values`` (``[]`` on a rank that computes no loss: zeros
    and neutral extremes).  One device-to-host copy for the whole step. Collective."""
    sums = {f"train/{name}": 0.0 for name in terms}
    folded = {f"train/{name}": neutral_extremum(name) for name in extremes}
    if values:
        table = _to_host_table([[v[name] for name in terms] for v in values])
        for j, name in enumerate(terms):
            sums[f"train/{name}"] = float(table[:, j].sum())
    for v in values:
        for name in folded:
            folded[name] = fold_extremum(name, folded[name], float(v[name.removeprefix("train/")]))
    return {**dp.sum(sums), **all_reduce_extrema(folded)}


def mean_over_steps(per_step: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each metric over the optimizer steps, the extremes' min / max over their finite values instead
    (omitted without any)."""
    totals: dict[str, float] = {}
    extremes: dict[str, list[float]] = {}
    for metrics in per_step:
        for name, value in metrics.items():
            if name.endswith(EXTREMA):
                extremes.setdefault(name, []).append(value)
            else:
                totals[name] = totals.get(name, 0.0) + value
    return {**{name: value / len(per_step) for name, value in totals.items()}, **extrema_over_steps(extremes)}


def metrics_over_steps(values_by_step: Sequence[Sequence[Mapping[str, Tensor]]],
                       scalars_by_step: Sequence[Mapping[str, float]], terms: Sequence[str], extremes: Sequence[str],
                       dp: DataParallel) -> dict[str, float]:
    """A rollout's training metrics: each optimizer step's :func:`step_loss_metrics` of its per-micro-batch ``values``
    with that step's ``scalars`` (grad norm, learning rate, the backend's own), then :func:`mean_over_steps`.
    Collective (one reduction per step, in step order)."""
    return mean_over_steps([{**step_loss_metrics(values, terms, extremes, dp), **scalars}
                            for values, scalars in zip(values_by_step, scalars_by_step, strict=True)])


def mismatch_monitor(samples: Sequence[Sample], train_log_probs: Sequence[Tensor] | None,
                     placeholder_ids: Collection[int], route_sums: Mapping[str, float], dp: DataParallel,
                     threshold: float | None, rollout_id: int) -> dict[str, float]:
    """The monitor's metrics (module docstring) of a step's old-log-prob pass, the same on every rank, then the gate.

    Args:
        samples, train_log_probs: this rank's samples and their trainer log-probs (None on a rank that computes no
            loss: it adds zeros).
        placeholder_ids: the response ids the trainer does not feed as the engine did.
        route_sums: this rank's router agreement sums (:meth:`slime.routing_replay.StepRoutes.after_old_pass`).
        dp: the reduction over ranks.  threshold, rollout_id: the gate's bound and the step it names.

    Raises:
        LogprobGapError: a prompt kind's mean gap passes ``threshold`` (:func:`check_gap_threshold`).
    """
    sums = logprob_gap_sums(samples if train_log_probs is not None else [], train_log_probs or [], placeholder_ids)
    metrics = logprob_gap_metrics(dp.sum({**sums, **route_sums}))
    check_gap_threshold(metrics, threshold, rollout_id)
    return metrics


def _to_host_table(rows: list[list[Tensor | float]]) -> Tensor:
    """Scalars (0-d tensors on one device, or numbers) as one float64 ``[len(rows), len(rows[0])]`` CPU tensor, copied
    to the host at once."""
    flat = [torch.as_tensor(x).detach() for row in rows for x in row]
    device = next((x.device for x in flat if x.device.type != "cpu"), torch.device("cpu"))
    table = torch.stack([x.to(device=device, dtype=torch.float64).reshape(()) for x in flat])
    return table.cpu().view(len(rows), -1)
