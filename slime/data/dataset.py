"""Dataset rows -> prompt samples: images, chat template, limits, skips, shuffling, cursor.

A row becomes a :class:`slime.data.sample.Sample` (:meth:`PromptDataset.make_sample`): (1) the
``--input-key`` text holds one :data:`IMAGE_PLACEHOLDER` per image of the ``image`` column, in order
(checked for every row at load, nothing decoded); (2) each image is decoded; then one call,
:meth:`slime.data.processor.VLProcessor.prompt`: (3) each image is resized once to RGB (a fixed point), and
the engine gets PNGs of the resized images, so engine and trainer count the same image tokens; (4) with
``--apply-chat-template`` the text becomes one user message of image / text items rendered by the chat
template, else each placeholder becomes :data:`slime.data.processor.VISION_SPAN`; (5) the processor
tokenises it and expands the image tokens.

Rows with an unreadable image, an empty label or a prompt over ``--rollout-max-prompt-len`` tokens
are skipped, never silently: logged with index and id, counted (:attr:`PromptDataset.skip_counts`)
and replaced by the next row.  The cursor is ``(epoch, position)``; with ``--rollout-shuffle`` epoch
``e`` visits ``numpy.random.default_rng([seed, e]).permutation(N)``, else file order; it is saved and
restored with the skip counts, so a resumed run draws the batches the uninterrupted run would have.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slime.data.config import DataConfig
from slime.data.image import ImageDecodeError, decode_image, encode_image_base64
from slime.data.processor import ImageSizeError
from slime.data.sample import Sample
from slime.data.sources import LISTED_ROWS, DatasetError, list_rows, load_table
from slime.utils.config import ConfigError

if TYPE_CHECKING:
    from slime.data.processor import VLProcessor

logger = logging.getLogger(__name__)

IMAGE_PLACEHOLDER = "<image>"
"""Marks where an image goes in the prompt text, one per item of the image column."""

SKIP_REASONS = ("bad_image", "empty_label", "prompt_too_long")
"""Why a row can be skipped; the keys of :attr:`PromptDataset.skip_counts`."""

class PromptDataset:
    """Rows of one dataset split, turned into prompt :class:`Sample` s on demand.

    Args:
        cfg: the data flags.
        processor: the model's processor; its pixel bounds fix the images' size for engine and trainer.
        seed: ``--rollout-seed`` (the shuffle's).
        source: ``--prompt-data`` by default, or an ``--eval-prompt-data`` path.
        split: default split for folders and hub names; flag_name: the flag that named ``source``.

    Raises:
        ConfigError: no source, a source that does not load, or a configured column missing (the
            message lists the columns that exist).
        DatasetError: no rows; the ``--input-key`` column is not text; rows with a null prompt or a
            placeholder count that differs from their image count (up to :data:`LISTED_ROWS` named).
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
        """Check every row's :data:`IMAGE_PLACEHOLDER` count against its images (Arrow kernels, nothing decoded).

        Raises:
            DatasetError: see :class:`PromptDataset`.
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
        """Rows N in the split (before skips)."""
        return self._table.num_rows

    @property
    def epoch(self) -> int:
        """The epoch the next row is drawn from (completed passes)."""
        return self._epoch

    @property
    def skip_counts(self) -> dict[str, int]:
        """Rows skipped since the start of the run, by reason (:data:`SKIP_REASONS`); a copy."""
        return dict(self._skip_counts)

    # ------------------------------------------------------------------ iteration

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices, int64 ``[num_rows]``, in the order epoch ``epoch`` visits them."""
        if not self.cfg.rollout_shuffle:
            return np.arange(self.num_rows)
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_batch(self, num_prompts: int) -> list[Sample]:
        """The next ``num_prompts`` valid prompts from the cursor (``group_index`` -1), wrapping into the next epoch.

        Raises:
            ValueError: ``num_prompts < 1``.
            DatasetError: ``num_rows`` rows in a row were skipped (with the skip counts and flags to check),
                or a row error of :meth:`make_sample`.
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

    def check_usable(self, flag_name: str = "--prompt-data") -> None:
        """Make sure some row is usable, before the run starts: rows in file order until one makes a sample.

        A dataset whose every row is skipped would otherwise fail in the first rollout step, after the engines
        and trainers started; the skip counts stay as they were (the rows tried are drawn again later).

        Raises:
            DatasetError: every row is skipped (with the skip counts and the flags to check).
        """
        counts, self._skip_counts = self._skip_counts, dict.fromkeys(SKIP_REASONS, 0)
        try:
            if any(self.make_sample(row) is not None for row in range(self.num_rows)):
                return
            raise DatasetError(
                f"{flag_name} {self.source}: all {self.num_rows} rows are skipped (by reason: {self.skip_counts}); "
                "check --label-key, the images and --rollout-max-prompt-len"
            )
        finally:
            self._skip_counts = counts

    def eval_samples(self) -> list[Sample]:
        """Every valid row once, in file order, never shuffled; the training cursor does not move."""
        samples = [self.make_sample(row) for row in range(self.num_rows)]
        return [sample for sample in samples if sample is not None]

    def state_dict(self) -> dict[str, Any]:
        """The cursor (``epoch``, ``position``, ``skip_counts``), and ``num_rows``, ``seed``, ``shuffle`` to check."""
        return dict(
            epoch=self._epoch,
            position=self._position,
            skip_counts=self.skip_counts,
            num_rows=self.num_rows,
            seed=self.seed,
            shuffle=self.cfg.rollout_shuffle,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by :meth:`state_dict` (another seed or shuffle only warns).

        Raises:
            DatasetError: the data has another number of rows, or the position is out of range.
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
        if "id" in self._table.column_names:
            return f"row {row} (id {self._table.column('id')[row].as_py()})"
        return f"row {row}"

    def make_sample(self, row: int, *, drop_images: bool = False, count_skips: bool = True) -> Sample | None:
        """Row ``row`` as a prompt sample, or ``None`` for a skipped row (logged and, with ``count_skips``, counted).

        ``drop_images``: the problem as text alone (the engine parity check).  The sample has ``index=row``,
        ``prompt``, ``label``, ``images`` (base64 PNGs), ``prompt_token_ids``, ``multimodal_inputs``
        (``pixel_values`` float32 ``[num_patches, C*T*P*P]``, ``image_grid_thw`` int64 ``[num_images, 3]``)
        and ``metadata`` (the row's other columns).

        Raises:
            DatasetError: the prompt is not a string, or its placeholders differ from its images.
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
            try:
                images.append(decode_image(item, base_dir=self._base_dir, field=f"{cfg.image_key}[{k}]"))
            except ImageDecodeError as e:  # its message names the field
                return self._skip(row, "bad_image", str(e), count_skips)
        try:
            processed = self.processor.prompt(text.split(IMAGE_PLACEHOLDER), images,
                                              chat_template=cfg.apply_chat_template,
                                              template_kwargs=cfg.apply_chat_template_kwargs)
        except ImageSizeError as e:  # e.g. aspect ratio above 200: no fixed-point size within the pixel bounds
            return self._skip(row, "bad_image", f"column {cfg.image_key!r}: {e}", count_skips)
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
            prompt=processed.text,
            label=label,
            images=[encode_image_base64(image) for image in processed.images],
            prompt_token_ids=list(processed.input_ids),
            multimodal_inputs=multimodal_inputs,
            metadata={key: value for key, value in record.items() if key not in used},
        )

    def _skip(self, row: int, reason: str, detail: str, count: bool = True) -> None:
        if count:
            self._skip_counts[reason] += 1
        logger.warning("skipping %s: %s: %s", self.row_name(row), reason, detail)
        return None


def _label_text(value: Any) -> str:
    """The label as written (.jsonl) or ``str`` of a column's number (``3.0`` -> ``"3.0"``); "" when missing."""
    return "" if value is None else str(value)


def _is_list_type(data_type: pa.DataType) -> bool:
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


def _image_items(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def load_eval_samples(cfg: DataConfig, processor: VLProcessor, path: str) -> list[Sample]:
    """Prompts of one ``--eval-prompt-data`` set (default split ``test``), every valid row once, built as in training.

    Raises:
        ConfigError, DatasetError: as :class:`PromptDataset`; DatasetError also when every row was skipped.
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
