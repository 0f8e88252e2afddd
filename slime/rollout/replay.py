"""Saved rollouts for a train-only replay: ``--save-debug-rollout-data`` writes them, ``--load-debug-rollout-data`` reads.

Beside each JSONL summary ``P`` (``--save-debug-rollout-data``) goes ``P`` with the suffix ``.pt``: one
``torch.save`` record of the rollout step, every field the trainers read (token ids, loss masks, rewards,
advantages, rollout log-probs, routes, ``pixel_values``), so a replay into the same starting checkpoint
reproduces the original step bit for bit (CPU).  A record carries the model's fingerprint and the batch
shape, and a load refuses one that does not fit this run, naming the file.  Why: ``docs/design/replay.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch

from slime.data.sample import Sample, SampleStatus
from slime.errors import SlimeError

FORMAT = "slime.debug_rollout/1"
"""The record's ``format`` key: what a load accepts."""
REPLAY_SUFFIX = ".pt"
DIR_TEMPLATE = "rollout_{rollout_id}" + REPLAY_SUFFIX
"""The file of rollout ``k`` when ``--load-debug-rollout-data`` names a folder."""


class ReplayError(SlimeError, ValueError):
    """A saved rollout is missing or does not fit this run (the message names the file and what differs)."""


def model_fingerprint(tokenizer, hf_config: dict) -> dict:
    """What a saved rollout must share with the run that replays it: the model type, the vocabulary (size and a
    SHA-256 of the sorted token -> id map) and the image token id."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return {"model_type": hf_config.get("model_type"), "vocab_size": len(tokenizer),
            "vocab_sha256": hashlib.sha256(vocab).hexdigest(), "image_token_id": hf_config.get("image_token_id")}


def replay_path(summary_path: str | Path) -> Path:
    """The record written beside a formatted ``--save-debug-rollout-data`` path (its suffix replaced by ``.pt``)."""
    return Path(summary_path).with_suffix(REPLAY_SUFFIX)


def save_rollout(path: Path, rollout_id: int, samples: list[Sample], metrics: dict[str, float],
                 fingerprint: dict, n_samples_per_prompt: int) -> None:
    """Write one rollout step's record to ``path`` (``torch.load(weights_only=True)`` can read it)."""
    record = {"format": FORMAT, "rollout_id": rollout_id, "fingerprint": fingerprint,
              "n_samples_per_prompt": n_samples_per_prompt, "metrics": dict(metrics),
              "samples": [_to_record(s) for s in samples]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(record, tmp)
    tmp.replace(path)


def replay_template(source: str) -> str:
    """The record path of rollout ``{rollout_id}`` that ``--load-debug-rollout-data`` ``source`` names: a folder's
    ``rollout_{rollout_id}.pt``, else the path given to ``--save-debug-rollout-data`` with the suffix ``.pt``."""
    return str(Path(source) / DIR_TEMPLATE) if Path(source).is_dir() else str(replay_path(source))


def check_saved_rollouts(source: str, rollout_ids: range) -> None:
    """Before anything starts: every record a replay of ``rollout_ids`` reads exists (contents are checked as each
    is loaded, :func:`load_rollout`).

    Raises:
        ReplayError: ``source`` is neither a folder nor a saved path, or some records are missing (named, with the
            saved ids found).
    """
    template = replay_template(source)
    if not Path(source).is_dir() and not Path(template).parent.is_dir():
        raise ReplayError(f"--load-debug-rollout-data {source}: no such folder (give the folder of the saved rollouts "
                          "or the --save-debug-rollout-data path)")
    missing = [k for k in rollout_ids if not Path(template.format(rollout_id=k)).is_file()]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise ReplayError(f"--load-debug-rollout-data {source}: this run replays rollouts {rollout_ids.start} to "
                          f"{rollout_ids.stop - 1}, and {len(missing)} are not saved ({shown}: "
                          f"{template.format(rollout_id=missing[0])} does not exist); saved rollout ids there: "
                          f"{saved_ids(template) or 'none'}. Lower --num-rollout, or save more rollouts")


def load_rollout(source: str, rollout_id: int, *, fingerprint: dict, n_samples_per_prompt: int,
                 num_samples: int, need_routes: bool = False) -> tuple[list[Sample], dict[str, float], Path]:
    """Rollout ``rollout_id``'s samples and metrics from ``--load-debug-rollout-data`` ``source``: a folder
    (``<folder>/rollout_{rollout_id}.pt``), or a path template as given to ``--save-debug-rollout-data`` (its suffix
    read as ``.pt``; one without ``{rollout_id}`` is the same file for every step, as upstream).

    Raises:
        ReplayError: the file is missing (the saved ids beside it listed), is not such a record, holds another
            rollout id, was saved from another model or tokenizer, or holds another batch shape than
            ``num_samples`` samples in groups of ``n_samples_per_prompt``, or (``need_routes``:
            ``--use-rollout-routing-replay``) holds samples without the engine's routed experts.
    """
    template = replay_template(source)
    path = Path(template.format(rollout_id=rollout_id))
    if not path.is_file():
        raise ReplayError(f"--load-debug-rollout-data: no saved rollout {rollout_id}: {path} does not exist "
                          f"(saved rollout ids there: {saved_ids(template) or 'none'})")
    try:
        record = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same error to the user
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ReplayError(f"--load-debug-rollout-data: {path} is not a saved rollout ({type(e).__name__}: "
                          f"{first_line})") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ReplayError(f"--load-debug-rollout-data: {path} is not a saved rollout of format {FORMAT!r}")
    if "{rollout_id}" in template and record["rollout_id"] != rollout_id:
        raise ReplayError(f"--load-debug-rollout-data: {path} holds rollout {record['rollout_id']}, not {rollout_id}")
    differs = {k: (record["fingerprint"].get(k), v) for k, v in fingerprint.items() if record["fingerprint"].get(k) != v}
    if differs:
        raise ReplayError(f"--load-debug-rollout-data: {path} was saved from another model or tokenizer than "
                          f"--hf-checkpoint ((saved, now): {differs})")
    shape = (len(record["samples"]), record["n_samples_per_prompt"])
    if shape != (num_samples, n_samples_per_prompt):
        raise ReplayError(f"--load-debug-rollout-data: {path} holds {shape[0]} samples in groups of {shape[1]}; this "
                          f"run's --rollout-batch-size x --n-samples-per-prompt is {num_samples // n_samples_per_prompt}"
                          f" x {n_samples_per_prompt}")
    unrouted = [r["index"] for r in record["samples"] if r.get("rollout_routed_experts") is None]
    if need_routes and unrouted:
        raise ReplayError(f"--load-debug-rollout-data: {path} was saved without the engine's routed experts "
                          f"({len(unrouted)} of {shape[0]} samples, first: dataset index {unrouted[0]}), which "
                          "--use-rollout-routing-replay replays; save the rollouts again with it, or replay them "
                          "without it")
    return [_from_record(r) for r in record["samples"]], record["metrics"], path


def saved_ids(template: str) -> list[int]:
    """The rollout ids of the files matching ``template`` (sorted)."""
    path = Path(template)
    if "{rollout_id}" not in path.name:
        return []
    pattern = re.compile(re.escape(path.name).replace(re.escape("{rollout_id}"), r"(\d+)") + "$")
    found = (pattern.match(p.name) for p in path.parent.glob("*")) if path.parent.is_dir() else ()
    return sorted(int(m.group(1)) for m in found if m)


def _to_record(sample: Sample) -> dict:
    record = {f.name: getattr(sample, f.name) for f in dataclasses.fields(Sample)}
    record["status"] = sample.status.value
    if sample.rollout_routed_experts is not None:
        record["rollout_routed_experts"] = torch.from_numpy(np.ascontiguousarray(sample.rollout_routed_experts))
    return record


def _from_record(record: dict) -> Sample:
    fields = dict(record)
    fields["status"] = SampleStatus(fields["status"])
    routes = fields.get("rollout_routed_experts")
    if routes is not None:
        fields["rollout_routed_experts"] = routes.numpy()
    return Sample(**fields)
