"""Dataset rows -> prompts: loading, images, chat template, limits, skips, shuffling, cursor.

The rollout manager asks a :class:`PromptDataset` for ``--rollout-batch-size`` prompts per
step with :meth:`PromptDataset.next_batch`; evaluation walks a dataset once with
:meth:`PromptDataset.eval_samples`.  Each prompt is a :class:`slime.utils.types.Sample`
with its prompt fields filled in.

Where rows come from (``--prompt-data``, ``--eval-prompt-data``; :func:`load_table`):

- a local ``.parquet`` or ``.jsonl`` file;
- a folder holding ``<split>.parquet`` (or ``<split>.jsonl``): ``train`` for training,
  ``test`` for evaluation (the bundled ``examples/geo3k_vlm/data``);
- otherwise a Hugging Face dataset name for ``datasets.load_dataset(name, split=split)``,
  e.g. ``chenhegu/geo3k_imgurl`` (what the launcher's ``SLIME_SCRIPT_DATASET_NAME``
  drives).  ``NAME@split`` (and ``FOLDER@split``) picks another split.

How a row becomes a prompt (:meth:`PromptDataset.make_sample`):

1. the ``--input-key`` text holds one :data:`IMAGE_PLACEHOLDER` per image of the
   ``--multimodal-keys`` ``image`` column, in order (the hiyouga/geometry3k convention,
   also used by slime).  Every row is checked when the dataset is loaded (placeholder
   count against the image list's length; nothing decoded), and a mismatch is one error
   naming the bad rows, so it cannot surface hours into a run;
2. each image is decoded to RGB (:func:`slime.utils.image.decode_image`) and resized
   **once** with ``processor.resize_image`` to the processor's pixel bounds.  The resize is
   a fixed point of the processor, and the base64 PNGs sent to the engine are of the
   resized images, so the engine and the trainer see the same image-token counts;
3. with ``--apply-chat-template`` the text becomes one user message whose content items
   are ``{"type": "image"}`` / ``{"type": "text"}`` in placeholder order, rendered by the
   model's chat template (``--apply-chat-template-kwargs`` passed through); without it
   each placeholder is replaced by the model's vision span (:data:`VISION_SPAN`);
4. the processor tokenises the prompt and expands the image tokens, giving
   ``prompt_token_ids`` and ``pixel_values`` / ``image_grid_thw``.

Labels are strings: a .jsonl label keeps its text as written, numbers included
(:func:`read_jsonl`).

Rows are skipped, never silently: an unreadable image, an empty or missing label, or a
prompt longer than ``--rollout-max-prompt-len`` tokens (images expanded).  Every skip is
logged (``logging.warning``, with the row index and id) and counted in
:attr:`PromptDataset.skip_counts` (cumulative, by reason), which the rollout manager
reports in each step's metrics.  A skipped row is replaced by the next row.

Order: rows are drawn from a cursor ``(epoch, position)``.  With ``--rollout-shuffle``
epoch ``e`` visits rows in the order ``numpy.random.default_rng([seed, e]).permutation(N)``
(a pure function of the seed and the epoch); without it, in file order.  The cursor and
the skip counts are saved with :meth:`PromptDataset.state_dict` and restored with
:meth:`PromptDataset.load_state_dict`, so a resumed run draws the batches the
uninterrupted run would have drawn.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from slime.utils.config import ConfigError, flag
from slime.utils.image import ImageDecodeError, decode_image, encode_image_base64
from slime.utils.processor import ImageSizeError
from slime.utils.types import Sample

if TYPE_CHECKING:
    from slime.utils.processor import VLProcessor

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
"""Marks where an image goes in the prompt text, one per item of the image column."""

VISION_SPAN = "<|vision_start|>{image_token}<|vision_end|>"
"""What replaces a placeholder without ``--apply-chat-template``: the span that the
Qwen2-VL / Qwen3-VL / Qwen3.5 chat templates render for an ``{"type": "image"}`` item,
formatted with ``processor.image_token``."""

SKIP_REASONS = ("bad_image", "empty_label", "prompt_too_long")
"""Why a row can be skipped; the keys of :attr:`PromptDataset.skip_counts`."""

LOCAL_SUFFIXES = (".parquet", ".jsonl")
"""File types ``--prompt-data`` reads directly."""

LISTED_ROWS = 10
"""Bad rows named in one error message; the rest are counted."""


class DatasetError(ValueError):
    """A dataset row or file cannot be used; the message names the file, row and field."""


def _json_object(text: str) -> dict:
    """argparse ``type=`` for JSON-object flags; argparse prefixes the error with the flag name."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e}); quote it for the shell") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


@dataclasses.dataclass
class DataConfig:
    """Prompt data (part of ROLLOUT_ARGS): where rows come from and how they become prompts."""

    prompt_data: str | None = flag(
        None,
        help="Training prompts: a .parquet/.jsonl file, a folder with train.parquet (or train.jsonl), or a Hugging "
        "Face dataset name; NAME@split (or FOLDER@split) picks another split than 'train'.",
    )
    input_key: str = flag("input", help="Column holding the prompt text (may contain <image> placeholders).")
    label_key: str | None = flag(
        "label",
        help="Column holding the ground-truth answer; rows whose label is missing or empty are skipped. A .jsonl "
        "number keeps its text as written (3 -> '3', 1e-3 -> '1e-3').",
    )
    multimodal_keys: dict | None = flag(
        None,
        type=_json_object,
        help='JSON map of modality -> column, e.g. \'{"image": "images"}\'. Only "image" is supported; the column '
        "holds a list of images (HF Image structs, paths, URLs, base64 / data URIs), one per <image> placeholder.",
    )
    apply_chat_template: bool = flag(False, help="Wrap the prompt in the model's chat template.")
    apply_chat_template_kwargs: dict = flag(
        default_factory=dict, type=_json_object, help="JSON kwargs for apply_chat_template, e.g. '{\"enable_thinking\": false}'."
    )
    rollout_shuffle: bool = flag(
        False, help="Shuffle prompts each epoch (deterministic in --rollout-seed and the epoch)."
    )
    rollout_max_prompt_len: int | None = flag(
        None, help="Skip (and count) rows whose prompt, images expanded, is longer than this many tokens."
    )
    image_min_pixels: int | None = flag(
        None, help="Lower bound on image area, pixels (default: the checkpoint's preprocessor config)."
    )
    image_max_pixels: int | None = flag(
        None,
        help="Upper bound on image area, pixels (default: the checkpoint's preprocessor config). Images are resized "
        "once, before rollout, so rollout and training see the same image tokens.",
    )

    def __post_init__(self):
        for name in ("rollout_max_prompt_len", "image_min_pixels", "image_max_pixels"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.image_min_pixels and self.image_max_pixels and self.image_min_pixels > self.image_max_pixels:
            raise ConfigError(
                f"--image-min-pixels ({self.image_min_pixels}) must be <= --image-max-pixels ({self.image_max_pixels})"
            )
        for name in ("multimodal_keys", "apply_chat_template_kwargs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"--{name.replace('_', '-')} must be a JSON object, got {value!r}")
        unknown = sorted(set(self.multimodal_keys or {}) - {"image"})
        if unknown:
            raise ConfigError(
                f"--multimodal-keys has unsupported modalities {unknown} ({self.multimodal_keys}); only 'image' is "
                "supported, e.g. '{\"image\": \"images\"}'"
            )
        if self.image_key is not None and (not isinstance(self.image_key, str) or not self.image_key):
            raise ConfigError(
                f"--multimodal-keys image must name a column, got {self.image_key!r}; e.g. '{{\"image\": \"images\"}}'"
            )
        if not self.input_key:
            raise ConfigError("--input-key must name the prompt column, got an empty string")

    @property
    def image_key(self) -> str | None:
        """The image column (``--multimodal-keys`` ``image``), or ``None`` for text-only data."""
        return (self.multimodal_keys or {}).get("image")


# ---------------------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where the rows of one split live: a local file, or a Hugging Face dataset name and split.

    Exactly one of ``path`` and ``hub_name`` is set.
    """

    path: str | None
    """Local ``.parquet`` / ``.jsonl`` file."""
    hub_name: str | None
    """Name for ``datasets.load_dataset``."""
    split: str
    """Split of the hub dataset (or of the folder the file was picked from)."""

    def __str__(self) -> str:
        return self.path if self.path is not None else f"{self.hub_name}@{self.split}"


def resolve_source(spec: str, *, default_split: str, flag_name: str = "--prompt-data") -> DataSource:
    """Decide what ``spec`` names (see the module docstring for the accepted forms).

    Args:
        spec: the ``--prompt-data`` / ``--eval-prompt-data`` value.
        default_split: the split of a folder or hub dataset when ``spec`` has no ``@split``
            (``"train"`` for training, ``"test"`` for evaluation).
        flag_name: the flag that carried ``spec``, for error messages.

    Raises:
        ConfigError: a path that looks local (ends in .parquet / .jsonl, or starts with
            ``/``, ``.`` or ``~``) does not exist, a file of another type, or a folder
            without ``<split>.parquet`` / ``<split>.jsonl``.  Anything else is taken as a
            hub name (checked when loaded).
    """
    location, split = spec, default_split
    if "@" in spec and not os.path.exists(spec):
        location, split = spec.rsplit("@", 1)
    path = os.path.expanduser(location)
    if os.path.isdir(path):
        for suffix in LOCAL_SUFFIXES:
            candidate = os.path.join(path, split + suffix)
            if os.path.isfile(candidate):
                return DataSource(path=candidate, hub_name=None, split=split)
        raise ConfigError(
            f"{flag_name} {spec!r}: the folder has no {split}.parquet or {split}.jsonl (it holds "
            f"{sorted(os.listdir(path))}); add the file, or name a file or FOLDER@split"
        )
    if os.path.isfile(path):
        if not path.endswith(LOCAL_SUFFIXES):
            raise ConfigError(f"{flag_name} {spec!r}: unsupported file type; use a .parquet or .jsonl file")
        return DataSource(path=path, hub_name=None, split=split)
    if path.endswith(LOCAL_SUFFIXES) or location.startswith(("/", ".", "~")):
        raise ConfigError(f"{flag_name} {spec!r}: file not found ({os.path.abspath(path)}); fix the path")
    return DataSource(path=None, hub_name=location, split=split)


@dataclasses.dataclass
class LoadedTable:
    """Rows of one dataset split, as an Arrow table, with where they came from.

    Attributes:
        table: the rows; image columns keep their stored form (e.g. ``{bytes, path}``
            structs), decoded later one row at a time.
        source: what was loaded (its ``str`` is used in messages).
        base_dir: folder that relative image paths resolve against (the file's folder;
            ``None`` for hub datasets).
    """

    table: pa.Table
    source: DataSource
    base_dir: str | None


def load_table(
    spec: str, *, default_split: str, flag_name: str = "--prompt-data", text_columns: Collection[str] = ()
) -> LoadedTable:
    """Load the rows that ``spec`` names (resolved by :func:`resolve_source`).

    Local files are read with pyarrow (parquet memory-mapped) or :func:`read_jsonl`; hub
    datasets through ``datasets.load_dataset(name, split=split)`` (which uses the
    ``datasets`` cache), with their Image columns read undecoded.

    Args:
        spec, default_split, flag_name: see :func:`resolve_source`.
        text_columns: columns whose JSON numbers keep their text in a .jsonl file (the
            label column; see :func:`read_jsonl`).  Parquet and hub data keep their stored types.

    Raises:
        ConfigError: see :func:`resolve_source`; or the hub dataset cannot be loaded (the
            message carries the ``datasets`` error).
        DatasetError: a malformed .jsonl line, or a .jsonl column whose values cannot share one
            type; or a file that is not parquet / UTF-8 text (the message names the flag and file).
    """
    source = resolve_source(spec, default_split=default_split, flag_name=flag_name)
    if source.path is None:
        return LoadedTable(table=_read_hub(source, spec=spec, flag_name=flag_name), source=source, base_dir=None)
    try:
        if source.path.endswith(".parquet"):
            table = pq.read_table(source.path, memory_map=True)
        else:
            table = read_jsonl(source.path, text_columns=text_columns)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        kind = "a parquet" if source.path.endswith(".parquet") else "a UTF-8 JSON-lines"
        raise DatasetError(f"{flag_name} {spec}: {source.path} cannot be read as {kind} file ({e})") from None
    except DatasetError as e:  # read_jsonl names the file and line; add the flag
        raise DatasetError(f"{flag_name} {spec}: {e}") from None
    return LoadedTable(table=table, source=source, base_dir=os.path.dirname(os.path.abspath(source.path)))


def read_jsonl(path: str, *, text_columns: Collection[str] = ()) -> pa.Table:
    """Read a JSON-lines file (one JSON object per line; blank lines ignored) into an Arrow table.

    The columns are every key that appears on any line, in order of first appearance; a
    line without a key has null there.  Each column's type is inferred from all its values.

    In ``text_columns`` a value is kept *as written*: a JSON string is its decoded text
    (``"3"`` -> ``3``), and a JSON number is its token exactly as it appears on the line,
    not a float or int re-formatted (``3`` -> ``3``, ``3.50`` -> ``3.50``, ``1e-3`` ->
    ``1e-3``, ``-0`` -> ``-0``; likewise Python's ``NaN`` / ``Infinity`` extensions).
    Without this, a column holding both ``3`` and ``3.5`` becomes float64 and ``3`` reads
    back as ``"3.0"``.  Other JSON values (``true``, lists, objects) are left as parsed.

    Raises:
        DatasetError: a line that is not valid JSON or not an object (the message gives the
            line number), or a column whose values cannot share one Arrow type (it names the column).
    """
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {line_number}: invalid JSON ({e}); fix or remove the line") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path} line {line_number}: expected a JSON object, got {type(row).__name__}")
            if any(_is_json_number(row.get(column)) for column in text_columns):
                # Parse again with every number kept as its token; only the text columns take it.
                as_written = json.loads(line, parse_int=str, parse_float=str, parse_constant=str)
                for column in text_columns:
                    if _is_json_number(row.get(column)):
                        row[column] = as_written[column]
            rows.append(row)
    names = list(dict.fromkeys(name for row in rows for name in row))
    columns = {}
    for name in names:
        try:
            columns[name] = pa.array([row.get(name) for row in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise DatasetError(
                f"{path}: column {name!r} holds values of different types across lines ({e}); make them agree"
            ) from None
    return pa.table(columns)


def _is_json_number(value: Any) -> bool:
    """Whether ``json.loads`` produced ``value`` from a JSON number (bool is a JSON literal, not a number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_hub(source: DataSource, *, spec: str, flag_name: str) -> pa.Table:
    import datasets  # heavy; only needed for hub datasets

    try:
        dataset = datasets.load_dataset(source.hub_name, split=source.split)
    except Exception as e:  # the hub client raises many types (offline, 404, bad split, ...)
        raise ConfigError(
            f"{flag_name} {spec!r}: not a local file or folder, and datasets.load_dataset({source.hub_name!r}, "
            f"split={source.split!r}) failed: {type(e).__name__}: {e}"
        ) from e
    # The Arrow view is the stored form: Image columns stay {bytes, path} structs, not decoded here.
    return dataset.with_format("arrow")[:]


# ---------------------------------------------------------------------------- prompts


class PromptDataset:
    """Rows of one dataset split, turned into prompt :class:`Sample` s on demand.

    Args:
        cfg: the data flags (columns, chat template, limits, shuffle).
        processor: the model's processor (:func:`slime.utils.processor.load_processor`
            with ``--image-min-pixels`` / ``--image-max-pixels``).  Its pixel bounds fix the
            size of the images sent to the engine and of the ``pixel_values`` the trainer
            receives, so both see the same image tokens.
        seed: ``--rollout-seed``; with ``cfg.rollout_shuffle``, epoch ``e`` uses the permutation
            ``numpy.random.default_rng([seed, e]).permutation(num_rows)``.
        source: ``--prompt-data`` by default; pass an ``--eval-prompt-data`` path for evaluation.
        split: default split for folders and hub names (``"train"``; ``"test"`` for eval).
        flag_name: the flag that named ``source``, for error messages.

    Raises:
        ConfigError: no source, a source that does not load (see :func:`load_table`), or a
            configured column (``--input-key``, ``--label-key``, ``--multimodal-keys``)
            missing from the data; the message lists the columns that exist.
        DatasetError: the dataset has no rows; or, from a scan of every row at load (no
            image decoded), the ``--input-key`` column is not text, or rows have a null
            prompt or a placeholder count that differs from their image count (the message
            names up to :data:`LISTED_ROWS` of them, with index and id, and counts the rest).
    """

    def __init__(
        self,
        cfg: DataConfig,
        processor: VLProcessor,
        *,
        seed: int,
        source: str | None = None,
        split: str = "train",
        flag_name: str = "--prompt-data",
    ):
        source = source if source is not None else cfg.prompt_data
        if not source:
            raise ConfigError(f"{flag_name} is required: a .parquet/.jsonl file, a folder or a Hugging Face dataset name")
        self.cfg = cfg
        self.processor = processor
        self.seed = seed
        label_columns = () if cfg.label_key is None else (cfg.label_key,)
        loaded = load_table(source, default_split=split, flag_name=flag_name, text_columns=label_columns)
        self.source, self._base_dir, self._table = str(loaded.source), loaded.base_dir, loaded.table
        if self._table.num_rows == 0:
            raise DatasetError(f"{self.source} has no rows; {flag_name} must name a non-empty split")
        self._check_columns()
        self._check_placeholders(flag_name)
        self._epoch = 0
        self._position = 0
        self._skip_counts = dict.fromkeys(SKIP_REASONS, 0)
        self._order_cache: tuple[int, np.ndarray] | None = None

    def _check_columns(self) -> None:
        columns = self._table.column_names
        for flag_name, column in (
            ("--input-key", self.cfg.input_key),
            ("--label-key", self.cfg.label_key),
            ("--multimodal-keys image", self.cfg.image_key),
        ):
            if column is not None and column not in columns:
                raise ConfigError(
                    f"{flag_name} {column!r}: no such column in {self.source}; its columns are {columns}. "
                    f"Set {flag_name.split()[0]} to one of them"
                )

    def _check_placeholders(self, flag_name: str) -> None:
        """Check every row's :data:`IMAGE_PLACEHOLDER` count against its number of images, at load.

        Only the prompt strings and the image lists' lengths are read (Arrow kernels over
        two columns); no image is decoded.  Images per row are counted as
        :meth:`make_sample` sees them: a list's length, 0 for null, 1 for a single value.

        Raises:
            DatasetError: the ``--input-key`` column is not text, or rows whose prompt is
                null or whose placeholder count differs from their image count; the message
                lists the first :data:`LISTED_ROWS` of them (index and id) and counts the rest.
        """
        cfg = self.cfg
        text = self._table.column(cfg.input_key)
        if pa.types.is_string_view(text.type):
            text = text.cast(pa.large_string())
        if pa.types.is_null(text.type):  # every prompt is null
            placeholders = np.full(self.num_rows, -1)
        elif pa.types.is_string(text.type) or pa.types.is_large_string(text.type):
            placeholders = pc.fill_null(pc.count_substring(text, IMAGE_PLACEHOLDER), -1).to_numpy()
        else:
            raise DatasetError(
                f"{flag_name} {self.source}: --input-key column {cfg.input_key!r} holds {text.type} values, expected "
                "the prompt text (strings); set --input-key to the text column"
            )
        images = np.zeros(self.num_rows, dtype=np.int64)
        if cfg.image_key is not None:
            column = self._table.column(cfg.image_key)
            if _is_list_type(column.type):
                images = pc.fill_null(pc.list_value_length(column), 0).to_numpy()
            else:
                images = pc.is_valid(column).to_numpy(zero_copy_only=False).astype(np.int64)
        bad_rows = np.flatnonzero(placeholders != images)
        if bad_rows.size == 0:
            return
        image_column = f"column {cfg.image_key!r}" if cfg.image_key else "no image column: --multimodal-keys is unset"
        problems = []
        for row in bad_rows[:LISTED_ROWS].tolist():
            if placeholders[row] < 0:
                problems.append(f"{self._row_label(row)}: the prompt is null")
            else:
                problems.append(f"{self._row_label(row)}: {placeholders[row]} placeholders, {images[row]} images")
        raise DatasetError(
            f"{flag_name} {self.source}: in {bad_rows.size} of {self.num_rows} rows the number of {IMAGE_PLACEHOLDER} "
            f"placeholders (--input-key column {cfg.input_key!r}) differs from the number of images ({image_column}): "
            f"{list_rows(problems, bad_rows.size)}. Each image needs one placeholder, in order; fix or remove these "
            "rows"
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_rows(self) -> int:
        """Number of rows N in the split (before skips)."""
        return self._table.num_rows

    @property
    def epoch(self) -> int:
        """The epoch the next row is drawn from (= number of completed passes)."""
        return self._epoch

    @property
    def skip_counts(self) -> dict[str, int]:
        """Rows skipped so far, cumulative since the start of the run, by reason (:data:`SKIP_REASONS`).

        A row skipped in two epochs counts twice.  A copy; safe to log.
        """
        return dict(self._skip_counts)

    # ------------------------------------------------------------------ iteration

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices in the order epoch ``epoch`` visits them, int64 ``[num_rows]``.

        ``numpy.random.default_rng([seed, epoch]).permutation(num_rows)`` with
        ``--rollout-shuffle`` (a pure function of seed and epoch), else ``0..N-1``.
        """
        if not self.cfg.rollout_shuffle:
            return np.arange(self.num_rows)
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_batch(self, num_prompts: int) -> list[Sample]:
        """The next ``num_prompts`` valid prompts, drawn from the cursor.

        Rows are read lazily; a skipped row is replaced by the following one, and the
        cursor wraps into the next epoch (a new order when shuffling).  A batch may thus
        span two epochs and, if ``num_prompts > num_rows``, hold a row twice.

        Returns:
            ``num_prompts`` samples; ``group_index`` is left at -1 (the rollout manager
            numbers the groups).

        Raises:
            ValueError: ``num_prompts < 1``.
            DatasetError: ``num_rows`` rows in a row were skipped (every row unusable):
                the message gives the skip counts and the flags to check; or a row error
                from :meth:`make_sample`.
        """
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        samples: list[Sample] = []
        skipped_in_a_row = 0
        while len(samples) < num_prompts:
            row = int(self.epoch_order(self._epoch)[self._position])
            self._position += 1
            if self._position == self.num_rows:
                self._epoch, self._position = self._epoch + 1, 0
            sample = self.make_sample(row)
            if sample is not None:
                samples.append(sample)
                skipped_in_a_row = 0
                continue
            skipped_in_a_row += 1
            if skipped_in_a_row >= self.num_rows:
                raise DatasetError(
                    f"{self.source}: the last {skipped_in_a_row} rows drawn (as many as the dataset has) were all "
                    f"skipped (skip counts so far: {self.skip_counts}); check --label-key, the images and "
                    "--rollout-max-prompt-len"
                )
        return samples

    def eval_samples(self) -> list[Sample]:
        """Every valid row once, in file order, never shuffled (for ``--eval-prompt-data``).

        Does not move the training cursor; skips are logged and counted as in training.
        """
        samples = [self.make_sample(row) for row in range(self.num_rows)]
        return [sample for sample in samples if sample is not None]

    def state_dict(self) -> dict[str, Any]:
        """The cursor, for checkpoints: ``epoch``, ``position`` (rows of that epoch already
        drawn), ``skip_counts``, plus ``num_rows``, ``seed`` and ``shuffle`` to check on load."""
        return dict(
            epoch=self._epoch,
            position=self._position,
            skip_counts=self.skip_counts,
            num_rows=self.num_rows,
            seed=self.seed,
            shuffle=self.cfg.rollout_shuffle,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by :meth:`state_dict`.

        Raises:
            DatasetError: the saved cursor was for a dataset with a different number of
                rows (the data changed, so the saved position means nothing), or the
                position is out of range.
        """
        if state["num_rows"] != self.num_rows:
            raise DatasetError(
                f"{self.source} has {self.num_rows} rows but the checkpoint's data cursor was saved for "
                f"{state['num_rows']}; resume with the same --prompt-data, or start the data from scratch"
            )
        if not 0 <= state["position"] < self.num_rows or state["epoch"] < 0:
            raise DatasetError(f"invalid data cursor in the checkpoint: epoch {state['epoch']}, position {state['position']}")
        if (state["seed"], state["shuffle"]) != (self.seed, self.cfg.rollout_shuffle):
            logger.warning(
                "resuming %s with --rollout-seed %s / --rollout-shuffle %s, but the checkpoint used %s / %s: the "
                "remaining order differs from the original run",
                self.source, self.seed, self.cfg.rollout_shuffle, state["seed"], state["shuffle"],
            )  # fmt: skip
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._skip_counts = dict.fromkeys(SKIP_REASONS, 0) | {k: int(v) for k, v in state["skip_counts"].items()}

    # ------------------------------------------------------------------ one row

    def row_name(self, row: int) -> str:
        """``"<source> row <index> (id <id>)"`` for messages; the id only when the data has an ``id`` column."""
        return f"{self.source} {self._row_label(row)}"

    def _row_label(self, row: int) -> str:
        """``"row <index> (id <id>)"``; the id only when the data has an ``id`` column."""
        if "id" in self._table.column_names:
            return f"row {row} (id {self._table.column('id')[row].as_py()})"
        return f"row {row}"

    def make_sample(self, row: int, *, drop_images: bool = False, count_skips: bool = True) -> Sample | None:
        """Turn row ``row`` into a prompt sample, or skip it (log, count, return ``None``).

        ``drop_images``: the same problem as text alone (its ``<image>`` placeholders and images left
        out; the engine parity check's text prompts).  ``count_skips=False``: a skip is logged but not
        counted (a row read outside the prompt stream, which counts it when it gets there).

        Returns:
            A :class:`Sample` with ``index=row``, ``prompt`` (text with one vision span
            per image, templated if ``--apply-chat-template``), ``label`` (``str``),
            ``images`` (base64 PNGs of the resized images), ``prompt_token_ids``
            (``list[int]``, images expanded), ``multimodal_inputs`` (``pixel_values``
            float32 ``[num_patches, C*T*P*P]``, ``image_grid_thw`` int64
            ``[num_images, 3]``; empty without images) and ``metadata`` (the row's other
            columns); or ``None`` for a skipped row.

        Raises:
            DatasetError: the prompt is not a string, or the number of
                :data:`IMAGE_PLACEHOLDER` in it differs from the number of images (both
                already checked for every row when the dataset was loaded).
        """
        record = self._table.slice(row, 1).to_pylist()[0]
        cfg = self.cfg
        text = record[cfg.input_key]
        if not isinstance(text, str):
            raise DatasetError(
                f"{self.row_name(row)}: --input-key column {cfg.input_key!r} holds {type(text).__name__} "
                f"({text!r:.80}), expected the prompt text"
            )
        label = "" if cfg.label_key is None else _label_text(record[cfg.label_key])
        if cfg.label_key is not None and not label.strip():
            return self._skip(row, "empty_label", f"--label-key column {cfg.label_key!r} is {record[cfg.label_key]!r}",
                              count_skips)

        items = _image_items(record[cfg.image_key]) if cfg.image_key else []
        if drop_images:
            text, items = text.replace(IMAGE_PLACEHOLDER, ""), []
        num_placeholders = text.count(IMAGE_PLACEHOLDER)
        if num_placeholders != len(items):
            raise DatasetError(
                f"{self.row_name(row)}: the prompt has {num_placeholders} {IMAGE_PLACEHOLDER} placeholders but column "
                f"{cfg.image_key!r} has {len(items)} images; each image needs one placeholder, in order"
            )
        images = []
        for k, item in enumerate(items):
            field = f"{cfg.image_key}[{k}]"
            try:
                images.append(self.processor.resize_image(decode_image(item, base_dir=self._base_dir, field=field)))
            except ImageDecodeError as e:  # its message names the field
                return self._skip(row, "bad_image", str(e), count_skips)
            except ImageSizeError as e:  # e.g. aspect ratio above 200: no fixed-point size within the pixel bounds
                return self._skip(row, "bad_image", f"field {field!r}: {e}", count_skips)

        prompt = self._render_prompt(text)
        processed = self.processor(prompt, images)
        if cfg.rollout_max_prompt_len is not None and len(processed.input_ids) > cfg.rollout_max_prompt_len:
            return self._skip(
                row,
                "prompt_too_long",
                f"{len(processed.input_ids)} prompt tokens (images expanded) > --rollout-max-prompt-len "
                f"{cfg.rollout_max_prompt_len}",
                count_skips,
            )
        multimodal_inputs = {}
        if images:
            multimodal_inputs = {"pixel_values": processed.pixel_values, "image_grid_thw": processed.image_grid_thw}
        used = {cfg.input_key, cfg.label_key, cfg.image_key}
        return Sample(
            index=row,
            prompt=prompt,
            label=label,
            images=[encode_image_base64(image) for image in images],
            prompt_token_ids=list(processed.input_ids),
            multimodal_inputs=multimodal_inputs,
            metadata={key: value for key, value in record.items() if key not in used},
        )

    def _render_prompt(self, text: str) -> str:
        """Prompt text with one vision span per placeholder (chat-templated if configured)."""
        pieces = text.split(IMAGE_PLACEHOLDER)
        if not self.cfg.apply_chat_template:
            return VISION_SPAN.format(image_token=self.processor.image_token).join(pieces)
        content: list[dict[str, str]] = []
        for k, piece in enumerate(pieces):
            if k > 0:
                content.append({"type": "image"})
            if piece:
                content.append({"type": "text", "text": piece})
        messages = [{"role": "user", "content": content}]
        return self.processor.apply_chat_template(
            messages, add_generation_prompt=True, **self.cfg.apply_chat_template_kwargs
        )

    def _skip(self, row: int, reason: str, detail: str, count: bool = True) -> None:
        if count:
            self._skip_counts[reason] += 1
        logger.warning("skipping %s: %s: %s", self.row_name(row), reason, detail)
        return None


def _label_text(value: Any) -> str:
    """The label as a string, unchanged ("" when missing).

    A .jsonl label is already its text as written (:func:`read_jsonl`); a number from a
    parquet or hub column is formatted with ``str`` (float64 ``3.0`` -> ``"3.0"``).
    """
    return "" if value is None else str(value)


def _is_list_type(data_type: pa.DataType) -> bool:
    """Arrow list types (``list_value_length`` gives their lengths)."""
    return any(
        check(data_type)
        for check in (
            pa.types.is_list,
            pa.types.is_large_list,
            pa.types.is_fixed_size_list,
            pa.types.is_list_view,
            pa.types.is_large_list_view,
        )
    )


def list_rows(descriptions: list[str], total: int, limit: int = LISTED_ROWS) -> str:
    """``"a; b; c"``, at most ``limit`` of ``descriptions``, then ``"; and N more"`` up to ``total`` rows."""
    shown = "; ".join(descriptions[:limit])
    more = total - min(len(descriptions), limit)
    return shown + (f"; and {more} more" if more > 0 else "")


def _image_items(value: Any) -> list:
    """The image column's value as a list (``None`` -> no images, a single value -> one image)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def load_eval_samples(cfg: DataConfig, processor: VLProcessor, path: str) -> list[Sample]:
    """Prompts of one ``--eval-prompt-data`` set: every valid row once, in file order.

    ``path`` takes the same forms as ``--prompt-data``; a folder or hub name defaults to
    its ``test`` split.  Rows are built exactly as for training (same columns, chat
    template, processor and limits); skipped rows are logged, and the totals are logged
    once at the end.

    Raises:
        ConfigError, DatasetError: as :class:`PromptDataset` and :meth:`PromptDataset.make_sample`.
        DatasetError: every row was skipped (the message names ``path`` and gives the skip
            counts), rather than an empty eval set failing later in the metrics.
    """
    dataset = PromptDataset(cfg, processor, seed=0, source=path, split="test", flag_name="--eval-prompt-data")
    samples = dataset.eval_samples()
    if not samples:
        raise DatasetError(
            f"--eval-prompt-data {path!r}: all {dataset.num_rows} rows of {dataset.source} were skipped (skip counts: "
            f"{dataset.skip_counts}); check --label-key, the images and --rollout-max-prompt-len, or drop this eval set"
        )
    logger.info(
        "eval data %s: %d prompts from %d rows (skipped: %s)", dataset.source, len(samples), dataset.num_rows,
        dataset.skip_counts,
    )  # fmt: skip
    return samples
