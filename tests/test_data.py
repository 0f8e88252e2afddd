"""slime.data (rows, prompts, cursor) on real Geometry3K rows (the bundled sample) and the tiny Qwen3.5 checkpoint.

References used below, independent of the code under test:
- the engine's view of an image: transformers' ``Qwen2VLImageProcessorPil`` loaded straight
  from the checkpoint, run on the base64 PNG the engine receives;
- prompt strings written out by hand in the Qwen chat format;
- shuffle orders from the documented formula ``default_rng([seed, epoch]).permutation(N)``;
- resumed runs against the same run without the interruption.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from slime.data.config import DataConfig
from slime.data.dataset import PromptDataset, load_eval_samples
from slime.data.image import decode_image
from slime.data.processor import load_processor
from slime.data.sources import DatasetError, resolve_source
from slime.utils.config import ConfigError

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SAMPLE_DIR = os.path.join(REPO, "examples", "geo3k_vlm", "data")
TRAIN = os.path.join(SAMPLE_DIR, "train.parquet")
TEST = os.path.join(SAMPLE_DIR, "test.parquet")
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


def geo3k_config(**overrides) -> DataConfig:
    """The geo3k recipe's data flags."""
    values = dict(
        prompt_data=TRAIN,
        input_key="problem",
        label_key="answer",
        multimodal_keys={"image": "images"},
        apply_chat_template=True,
    )
    return DataConfig(**(values | overrides))


def sample_rows(path: str = TRAIN, n: int | None = None) -> list[dict]:
    rows = pq.read_table(path).to_pylist()
    return rows if n is None else rows[:n]


def write_parquet(path, rows: list[dict]) -> str:
    """Rows with the bundled sample's schema (HF feature metadata included)."""
    schema = pq.read_schema(TRAIN)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def reference_engine_tokens(tiny_ckpt, base64_png: str) -> int:
    """Image tokens of an engine-side re-processing: HF image processor with the checkpoint's bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_ckpt)
    image = Image.open(io.BytesIO(base64.b64decode(base64_png))).convert("RGB")
    grid = image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod()) // image_processor.merge_size**2


# ---------------------------------------------------------------------------- prompts


def test_geo3k_sample_fields(processor, tiny_ckpt):
    rows = sample_rows()
    dataset = PromptDataset(geo3k_config(), processor, seed=1)
    (sample,) = dataset.next_batch(1)
    row = rows[0]
    assert sample.index == 0
    assert sample.label == row["answer"]
    assert sample.metadata == {k: row[k] for k in ("id", "split", "choices", "answer_letter")}
    text = row["problem"].replace("<image>", "")
    assert sample.prompt == f"<|im_start|>user\n{VISION}{text}<|im_end|>\n<|im_start|>assistant\n<think>\n"

    # the image sent to the engine is the resized one, and the engine counts the same tokens
    (b64,) = sample.images
    engine_tokens = reference_engine_tokens(tiny_ckpt, b64)
    assert sample.prompt_token_ids.count(processor.image_token_id) == engine_tokens
    grid = sample.multimodal_inputs["image_grid_thw"]
    assert grid.dtype == torch.int64 and grid.shape == (1, 3)
    assert int(grid.prod()) // 4 == engine_tokens
    pixel_values = sample.multimodal_inputs["pixel_values"]
    assert pixel_values.dtype == torch.float32 and pixel_values.shape == (int(grid.prod()), 3 * 2 * 16 * 16)

    # the prompt ids are the tokenizer's ids of the prompt with the image pad repeated
    expanded = sample.prompt.replace("<|image_pad|>", "<|image_pad|>" * engine_tokens)
    assert sample.prompt_token_ids == processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("max_pixels", [None, 64 * 64], ids=["checkpoint-bounds", "narrower-bounds"])
def test_large_image_same_tokens_here_and_in_engine(tmp_path, tiny_ckpt, max_pixels):
    """An image far above max_pixels: the resized base64 image is a fixed point for the engine."""
    processor = load_processor(tiny_ckpt, max_pixels=max_pixels)
    row = sample_rows(n=1)[0]
    big = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB").resize((1531, 977))
    assert big.width * big.height > processor.max_pixels
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    row["images"] = [{"bytes": buffer.getvalue(), "path": None}]
    path = write_parquet(tmp_path / "big.parquet", [row])

    (sample,) = PromptDataset(geo3k_config(prompt_data=path), processor, seed=0).next_batch(1)
    sent = Image.open(io.BytesIO(base64.b64decode(sample.images[0])))
    assert sent.width * sent.height <= processor.max_pixels
    assert sent.width % 32 == 0 and sent.height % 32 == 0
    here = sample.prompt_token_ids.count(processor.image_token_id)
    assert here == reference_engine_tokens(tiny_ckpt, sample.images[0])
    # and re-processing the received image with our own processor changes nothing either
    again = processor(sample.prompt, [sent.convert("RGB")])
    assert again.input_ids == sample.prompt_token_ids
    assert np.array_equal(again.pixel_values.numpy(), sample.multimodal_inputs["pixel_values"].numpy())


def test_placeholders_map_to_images_in_order(tmp_path, processor):
    rows = sample_rows(n=2)
    row = dict(rows[0])
    row["problem"] = "Compare <image> with <image> now."
    row["images"] = [rows[0]["images"][0], rows[1]["images"][0]]
    path = write_parquet(tmp_path / "two.parquet", [row])

    (sample,) = PromptDataset(geo3k_config(prompt_data=path), processor, seed=0).next_batch(1)
    assert sample.prompt == (
        f"<|im_start|>user\nCompare {VISION} with {VISION} now.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    # image k of the prompt is image k of the row: compare each sent image with the row's, resized
    for k, b64 in enumerate(sample.images):
        original = Image.open(io.BytesIO(row["images"][k]["bytes"])).convert("RGBA")
        white = Image.new("RGBA", original.size, "white")
        expected = processor.resize_image(Image.alpha_composite(white, original).convert("RGB"))
        sent = Image.open(io.BytesIO(base64.b64decode(b64)))
        assert np.array_equal(np.asarray(sent), np.asarray(expected))
    assert sample.multimodal_inputs["image_grid_thw"].shape == (2, 3)


def test_without_chat_template_and_template_kwargs(processor):
    row = sample_rows(n=1)[0]
    text = row["problem"].replace("<image>", "")
    plain = PromptDataset(geo3k_config(apply_chat_template=False), processor, seed=0).next_batch(1)[0]
    assert plain.prompt == VISION + text
    no_think = PromptDataset(
        geo3k_config(apply_chat_template_kwargs={"enable_thinking": False}), processor, seed=0
    ).next_batch(1)[0]
    assert no_think.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_text_only_rows(tmp_path, processor):
    path = tmp_path / "text.jsonl"
    path.write_text(json.dumps({"question": "What is 2+3?", "answer": 5}) + "\n")
    cfg = DataConfig(prompt_data=str(path), input_key="question", label_key="answer", apply_chat_template=True)
    (sample,) = PromptDataset(cfg, processor, seed=0).next_batch(1)
    assert sample.prompt == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert sample.label == "5" and sample.images == [] and sample.multimodal_inputs == {}


def test_jsonl_with_file_paths_and_imgurl_data_uris(tmp_path, processor):
    """Relative image paths resolve against the .jsonl's folder; geo3k_imgurl's 'data:image/None' prefix decodes."""
    rows = sample_rows(n=2)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(rows[0]["images"][0]["bytes"])
    data_uri = "data:image/None;base64," + base64.b64encode(rows[1]["images"][0]["bytes"]).decode()
    lines = [
        {"problem": rows[0]["problem"], "answer": rows[0]["answer"], "images": ["imgs/a.png"]},
        {"problem": rows[1]["problem"], "answer": rows[1]["answer"], "images": [data_uri]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    from_jsonl = PromptDataset(geo3k_config(prompt_data=str(path)), processor, seed=0).next_batch(2)
    from_parquet = PromptDataset(geo3k_config(), processor, seed=0).next_batch(2)
    for a, b in zip(from_jsonl, from_parquet):
        assert a.images == b.images and a.prompt_token_ids == b.prompt_token_ids


# ---------------------------------------------------------------------------- loading


def test_folder_picks_train_and_eval_picks_test(processor):
    train = PromptDataset(geo3k_config(prompt_data=SAMPLE_DIR), processor, seed=0)
    assert train.num_rows == 64 and train.source == os.path.join(SAMPLE_DIR, "train.parquet")
    test_rows = sample_rows(TEST)
    evaluated = load_eval_samples(geo3k_config(rollout_shuffle=True), processor, SAMPLE_DIR)
    assert [s.index for s in evaluated] == list(range(16))  # once, in file order, never shuffled
    assert [s.metadata["id"] for s in evaluated] == [r["id"] for r in test_rows]
    at_split = PromptDataset(geo3k_config(prompt_data=SAMPLE_DIR + "@test"), processor, seed=0)
    assert at_split.num_rows == 16


def test_hub_name_calls_load_dataset(monkeypatch, processor):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_parquet(TEST)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dataset = PromptDataset(geo3k_config(prompt_data="chenhegu/geo3k_imgurl"), processor, seed=0)
    load_eval_samples(geo3k_config(), processor, "chenhegu/geo3k_imgurl")
    PromptDataset(geo3k_config(prompt_data="chenhegu/geo3k_imgurl@validation"), processor, seed=0)
    assert calls == [
        ("chenhegu/geo3k_imgurl", "train"),
        ("chenhegu/geo3k_imgurl", "test"),
        ("chenhegu/geo3k_imgurl", "validation"),
    ]
    assert dataset.source == "chenhegu/geo3k_imgurl@train"
    # rows come through undecoded and give the same prompts as the local file
    hub_samples = dataset.next_batch(3)
    local_samples = PromptDataset(geo3k_config(prompt_data=TEST), processor, seed=0).next_batch(3)
    assert [s.prompt_token_ids for s in hub_samples] == [s.prompt_token_ids for s in local_samples]
    assert [s.images for s in hub_samples] == [s.images for s in local_samples]


def test_hub_failure_is_a_clear_error(monkeypatch, processor):
    def failing_load_dataset(name, split):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", failing_load_dataset)
    with pytest.raises(ConfigError, match=r"--prompt-data 'someone/geo3k'.*load_dataset\('someone/geo3k'.*offline"):
        PromptDataset(geo3k_config(prompt_data="someone/geo3k"), processor, seed=0)


def test_missing_file_and_folder_without_split(tmp_path, processor):
    with pytest.raises(ConfigError, match=r"--prompt-data .*nope\.parquet.*file not found"):
        PromptDataset(geo3k_config(prompt_data=str(tmp_path / "nope.parquet")), processor, seed=0)
    with pytest.raises(ConfigError, match=r"--eval-prompt-data .*no test\.parquet or test\.jsonl"):
        load_eval_samples(geo3k_config(), processor, str(tmp_path))
    with pytest.raises(ConfigError, match="--prompt-data is required"):
        PromptDataset(geo3k_config(prompt_data=None), processor, seed=0)


def test_resolve_source_forms(tmp_path):
    assert resolve_source(TRAIN, default_split="train").path == TRAIN
    assert resolve_source(SAMPLE_DIR, default_split="test").path == TEST
    hub = resolve_source("chenhegu/geo3k_imgurl@test", default_split="train")
    assert (hub.hub_name, hub.split, hub.path) == ("chenhegu/geo3k_imgurl", "test", None)
    (tmp_path / "rows.csv").write_text("a\n1\n")
    with pytest.raises(ConfigError, match="unsupported file type"):
        resolve_source(str(tmp_path / "rows.csv"), default_split="train")


@pytest.mark.parametrize(
    "override, flag_name, column",
    [
        (dict(input_key="question"), "--input-key", "question"),
        (dict(label_key="solution"), "--label-key", "solution"),
        (dict(multimodal_keys={"image": "image"}), "--multimodal-keys image", "image"),
    ],
)
def test_missing_column_names_flag_and_columns(processor, override, flag_name, column):
    with pytest.raises(ConfigError) as info:
        PromptDataset(geo3k_config(**override), processor, seed=0)
    message = str(info.value)
    assert message.startswith(f"{flag_name} {column!r}: no such column")
    assert "'problem', 'answer', 'images', 'id', 'split', 'choices', 'answer_letter'" in message


def test_malformed_jsonl_line(tmp_path, processor):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n{"problem": \n')
    with pytest.raises(DatasetError, match=rf"^--prompt-data {path}: {path} line 2: invalid JSON"):
        PromptDataset(geo3k_config(prompt_data=str(path), multimodal_keys=None), processor, seed=0)


@pytest.mark.parametrize(
    "name, content, kind",
    [("broken.parquet", b"not a parquet file\n", "a parquet"),
     ("truncated.parquet", b"PAR1" + b"\x00" * 16, "a parquet"),
     ("binary.jsonl", b"\xff\xfe\x00garbage", "a UTF-8 JSON-lines")],
)
def test_unreadable_file_names_flag_and_file(tmp_path, processor, name, content, kind):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DatasetError) as info:
        PromptDataset(geo3k_config(prompt_data=str(path), multimodal_keys=None), processor, seed=0)
    assert str(info.value).startswith(f"--prompt-data {path}: {path} cannot be read as {kind} file (")


def test_jsonl_labels_keep_their_text(tmp_path, processor):
    """A JSON number label is its token as written in the file; a JSON string label is its text."""
    written = ["3", "3.5", '"3"', "1e-3", "3.50", "-0", "2E+2", '"\\\\frac{1}{2}"']
    expected = ["3", "3.5", "3", "1e-3", "3.50", "-0", "2E+2", "\\frac{1}{2}"]  # by hand
    path = tmp_path / "labels.jsonl"
    lines = [f'{{"id": {k}, "question": "q{k}", "answer": {label}}}\n' for k, label in enumerate(written)]
    path.write_text("".join(lines))
    cfg = DataConfig(prompt_data=str(path), input_key="question", label_key="answer")
    samples = PromptDataset(cfg, processor, seed=0).eval_samples()
    assert [s.label for s in samples] == expected
    assert [s.metadata["id"] for s in samples] == list(range(len(written)))  # other columns keep their JSON types

    # the same column through hand-written lines with ints and floats only (the Arrow-coercion case)
    path.write_text('{"question": "a", "answer": 3}\n{"question": "b", "answer": 3.5}\n')
    assert [s.label for s in PromptDataset(cfg, processor, seed=0).next_batch(2)] == ["3", "3.5"]


def test_jsonl_columns_from_every_line(tmp_path, processor):
    path = tmp_path / "later.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "answer": "2", "source": "x"}\n')
    cfg = DataConfig(prompt_data=str(path), input_key="question", label_key="answer")
    samples = PromptDataset(cfg, processor, seed=0).next_batch(2)
    assert [s.metadata for s in samples] == [{"source": None}, {"source": "x"}]
    path.write_text('{"question": "a", "answer": "1", "source": "x"}\n{"question": "b", "answer": "2", "source": [1]}')
    with pytest.raises(DatasetError, match=r"later\.jsonl: column 'source' holds values of different types"):
        PromptDataset(cfg, processor, seed=0)


def test_unsupported_modality_flag():
    with pytest.raises(ConfigError, match=r"--multimodal-keys has unsupported modalities \['video'\]"):
        geo3k_config(multimodal_keys={"image": "images", "video": "videos"})


# ---------------------------------------------------------------------------- row errors and skips


@pytest.mark.parametrize("problem", ["<image><image>Find x.", "Find x."], ids=["two-for-one", "none-for-one"])
def test_placeholder_count_mismatch_names_row_at_load(tmp_path, processor, problem):
    rows = sample_rows(n=3)
    rows[2]["problem"] = problem
    path = write_parquet(tmp_path / "mismatch.parquet", rows)
    expected_count = problem.count("<image>")
    with pytest.raises(DatasetError) as info:
        PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)  # found before any row is drawn
    message = str(info.value)
    assert message.startswith(f"--prompt-data {path}: in 1 of 3 rows ")
    assert f"row 2 (id {rows[2]['id']}): {expected_count} placeholders, 1 images" in message


def test_placeholder_scan_lists_ten_bad_rows_then_counts(tmp_path, processor):
    rows = sample_rows()
    image_a, image_b = rows[0]["images"][0], rows[1]["images"][0]
    for position in (3, 9, 17, 20, 21):
        rows[position]["problem"] += " <image>"  # one placeholder too many
    for position in (5, 30, 41):
        rows[position]["images"] = [image_a, image_b]  # one image too many
    for position in (11, 44):
        rows[position]["images"] = None  # no images, one placeholder
    for position in (50, 58, 63):
        rows[position]["problem"] = rows[position]["problem"].replace("<image>", "")
    rows[7]["problem"] = "Compare <image> and <image>."
    rows[7]["images"] = [image_a, image_b]  # two and two: fine
    path = write_parquet(tmp_path / "many.parquet", rows)

    # the reference: count in Python, row by row
    bad = []
    for k, row in enumerate(rows):
        placeholders, images = row["problem"].count("<image>"), len(row["images"] or [])
        if placeholders != images:
            bad.append(f"row {k} (id {row['id']}): {placeholders} placeholders, {images} images")
    assert len(bad) == 13

    for load in (
        lambda: PromptDataset(geo3k_config(prompt_data=path), processor, seed=0),
        lambda: load_eval_samples(geo3k_config(), processor, path),
    ):
        with pytest.raises(DatasetError) as info:
            load()
        message = str(info.value)
        assert "in 13 of 64 rows" in message and "column 'problem'" in message and "column 'images'" in message
        assert "; ".join(bad[:10]) + "; and 3 more. " in message
        assert not any(entry in message for entry in bad[10:])
    assert str(info.value).startswith(f"--eval-prompt-data {path}: ")


def test_placeholder_scan_decodes_no_image(tmp_path, processor, monkeypatch):
    """Loading reads only text and list lengths; images are decoded when their row is drawn."""
    import slime.data.dataset as data_module

    decoded = []

    def counting_decode(item, **kwargs):
        decoded.append(kwargs["field"])
        return decode_image(item, **kwargs)

    monkeypatch.setattr(data_module, "decode_image", counting_decode)
    path, _ = _skip_fixture(tmp_path, {1: {"images": [{"bytes": b"not an image", "path": None}]}})
    dataset = PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)
    assert decoded == []
    assert [s.index for s in dataset.next_batch(1)] == [0]
    assert decoded == ["images[0]"]


def test_placeholder_scan_other_image_column_forms(tmp_path, processor):
    """A single image per row (not a list) counts as one, null as none; text-only data has none."""
    png = base64.b64encode(sample_rows(n=1)[0]["images"][0]["bytes"]).decode()
    single = tmp_path / "single.jsonl"
    lines = [
        {"id": "a", "problem": "<image>Find x.", "answer": "1", "image": png},
        {"id": "b", "problem": "Find y.", "answer": "2", "image": None},
        {"id": "c", "problem": "<image>Find z.", "answer": "3", "image": None},
    ]
    single.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(DatasetError, match=r"in 1 of 3 rows .*: row 2 \(id c\): 1 placeholders, 0 images\. "):
        PromptDataset(geo3k_config(prompt_data=str(single), multimodal_keys={"image": "image"}), processor, seed=0)
    single.write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    cfg = geo3k_config(prompt_data=str(single), multimodal_keys={"image": "image"})
    dataset = PromptDataset(cfg, processor, seed=0)
    assert [len(s.images) for s in dataset.next_batch(2)] == [1, 0]

    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"problem": "See <image>.", "answer": "1"}) + "\n")
    with pytest.raises(DatasetError, match=r"no image column.*: row 0: 1 placeholders, 0 images\. "):
        PromptDataset(geo3k_config(prompt_data=str(text_only), multimodal_keys=None), processor, seed=0)


def test_null_or_non_text_prompts_found_at_load(tmp_path, processor):
    rows = sample_rows(n=3)
    rows[1]["problem"] = None
    path = write_parquet(tmp_path / "null_prompt.parquet", rows)
    with pytest.raises(DatasetError, match=rf"in 1 of 3 rows .*: row 1 \(id {rows[1]['id']}\): the prompt is null\. "):
        PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text(json.dumps({"problem": 7, "answer": "1"}) + "\n")
    with pytest.raises(DatasetError, match=r"--input-key column 'problem' holds int64 values, expected the prompt"):
        PromptDataset(geo3k_config(prompt_data=str(numbers), multimodal_keys=None), processor, seed=0)


def _skip_fixture(tmp_path, rows_by_position: dict[int, dict]) -> tuple[str, list[dict]]:
    rows = sample_rows(n=8)
    for position, changes in rows_by_position.items():
        rows[position] = rows[position] | changes
    return write_parquet(tmp_path / "skips.parquet", rows), rows


def test_skip_unreadable_images(tmp_path, processor, caplog):
    rows = sample_rows(n=1)
    half_png = rows[0]["images"][0]["bytes"][:500]
    path, rows = _skip_fixture(
        tmp_path,
        {
            1: {"images": [{"bytes": half_png, "path": None}]},  # truncated PNG
            4: {"images": [{"bytes": None, "path": "missing/diagram.png"}]},  # no such file
            6: {"images": [{"bytes": b"not an image", "path": None}]},
        },
    )
    dataset = PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)
    with caplog.at_level(logging.WARNING, logger="slime.data.dataset"):
        batch = dataset.next_batch(5)
    assert [s.index for s in batch] == [0, 2, 3, 5, 7]  # skipped rows are replaced by the next ones
    assert dataset.skip_counts == {"bad_image": 3, "empty_label": 0, "prompt_too_long": 0}
    for position in (1, 4, 6):
        assert any(f"row {position} (id {rows[position]['id']})" in r.message and "bad_image" in r.message
                   for r in caplog.records)  # fmt: skip


def test_skip_extreme_aspect_ratio(tmp_path, processor):
    buffer = io.BytesIO()
    Image.new("RGB", (2000, 5), "white").save(buffer, format="PNG")  # aspect ratio 400 > 200
    path, _ = _skip_fixture(tmp_path, {0: {"images": [{"bytes": buffer.getvalue(), "path": None}]}})
    dataset = PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)
    assert [s.index for s in dataset.next_batch(2)] == [1, 2]
    assert dataset.skip_counts["bad_image"] == 1


def test_skip_empty_and_missing_labels(tmp_path, processor, caplog):
    path, rows = _skip_fixture(tmp_path, {0: {"answer": ""}, 3: {"answer": None}, 5: {"answer": "  "}})
    dataset = PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)
    with caplog.at_level(logging.WARNING, logger="slime.data.dataset"):
        batch = dataset.next_batch(5)
    assert [s.index for s in batch] == [1, 2, 4, 6, 7]
    assert dataset.skip_counts == {"bad_image": 0, "empty_label": 3, "prompt_too_long": 0}
    assert any(f"row 3 (id {rows[3]['id']}): empty_label" in r.message for r in caplog.records)


def test_skip_prompts_over_max_len(tmp_path, processor, tiny_ckpt, caplog):
    """The skipped rows are exactly those whose reference length (text tokens + engine image tokens) is over."""
    rows = sample_rows(n=16)
    path = write_parquet(tmp_path / "sixteen.parquet", rows)
    reference_lengths = []
    for row in rows:
        text = row["problem"].replace("<image>", "")
        b64 = base64.b64encode(row["images"][0]["bytes"]).decode()
        pads = "<|image_pad|>" * reference_engine_tokens(tiny_ckpt, b64)
        prompt = f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n<think>\n"
        reference_lengths.append(len(processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    limit = int(np.median(reference_lengths))
    expected_kept = [i for i, n in enumerate(reference_lengths) if n <= limit]
    assert 0 < len(expected_kept) < 16

    dataset = PromptDataset(geo3k_config(prompt_data=path, rollout_max_prompt_len=limit), processor, seed=0)
    with caplog.at_level(logging.WARNING, logger="slime.data.dataset"):
        batch = dataset.eval_samples()
    assert [s.index for s in batch] == expected_kept
    assert all(len(s.prompt_token_ids) <= limit for s in batch)
    assert dataset.skip_counts["prompt_too_long"] == 16 - len(expected_kept)
    first_skipped = min(set(range(16)) - set(expected_kept))
    assert any(f"row {first_skipped} " in r.message and "prompt_too_long" in r.message and
               f"{reference_lengths[first_skipped]} prompt tokens" in r.message for r in caplog.records)  # fmt: skip


def test_every_row_skipped_raises(tmp_path, processor):
    rows = [row | {"answer": ""} for row in sample_rows(n=4)]
    path = write_parquet(tmp_path / "empty_labels.parquet", rows)
    dataset = PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)
    with pytest.raises(DatasetError, match=r"last 4 rows drawn .* were all skipped.*'empty_label': 4"):
        dataset.next_batch(1)
    with pytest.raises(DatasetError, match=r"all 4 rows are skipped.*'empty_label': 4"):
        dataset.check_usable()
    rows[3] = sample_rows(n=4)[3]  # one usable row is enough, and the check counts no skip
    dataset = PromptDataset(geo3k_config(prompt_data=write_parquet(tmp_path / "one.parquet", rows)), processor, seed=0)
    dataset.check_usable()
    assert dataset.skip_counts == {"bad_image": 0, "empty_label": 0, "prompt_too_long": 0}


def test_eval_set_with_every_row_skipped_raises(tmp_path, processor):
    rows = [row | {"answer": ""} for row in sample_rows(TEST, n=3)] + [sample_rows(TEST, n=4)[3] | {"answer": None}]
    path = write_parquet(tmp_path / "bad_eval.parquet", rows)
    with pytest.raises(DatasetError) as info:
        load_eval_samples(geo3k_config(), processor, path)
    message = str(info.value)
    assert message.startswith(f"--eval-prompt-data {path!r}: all 4 rows")
    assert "'empty_label': 4" in message and "'bad_image': 0" in message
    # one usable row is enough
    rows[2] = sample_rows(TEST, n=3)[2]
    write_parquet(tmp_path / "bad_eval.parquet", rows)
    assert [s.index for s in load_eval_samples(geo3k_config(), processor, path)] == [2]


def test_empty_dataset_raises(tmp_path, processor):
    path = write_parquet(tmp_path / "none.parquet", [])
    with pytest.raises(DatasetError, match="has no rows"):
        PromptDataset(geo3k_config(prompt_data=path), processor, seed=0)


# ---------------------------------------------------------------------------- order and cursor


def _draw(dataset: PromptDataset, batch_sizes: list[int]) -> list[list[int]]:
    return [[s.index for s in dataset.next_batch(n)] for n in batch_sizes]


def test_unshuffled_order_and_epoch_wrap(processor):
    dataset = PromptDataset(geo3k_config(prompt_data=TEST), processor, seed=0)
    assert dataset.epoch == 0
    first, second = _draw(dataset, [10, 10])
    assert first == list(range(10))
    assert second == [10, 11, 12, 13, 14, 15, 0, 1, 2, 3]
    assert dataset.epoch == 1


def test_shuffle_deterministic_per_seed_and_epoch(processor):
    cfg = geo3k_config(prompt_data=TEST, rollout_shuffle=True)
    a = sum(_draw(PromptDataset(cfg, processor, seed=7), [16, 16]), [])
    b = sum(_draw(PromptDataset(cfg, processor, seed=7), [8, 8, 8, 8]), [])
    c = sum(_draw(PromptDataset(cfg, processor, seed=8), [16, 16]), [])
    assert a == b  # same seed -> same order, whatever the batch sizes
    epoch0, epoch1 = a[:16], a[16:]
    assert sorted(epoch0) == list(range(16)) and sorted(epoch1) == list(range(16))  # each row once per epoch
    assert epoch0 != epoch1  # a new order each epoch
    assert c != a  # another seed, another order
    assert epoch0 == np.random.default_rng([7, 0]).permutation(16).tolist()
    assert epoch1 == np.random.default_rng([7, 1]).permutation(16).tolist()


def test_resume_draws_the_same_batches(tmp_path, processor):
    path, _ = _skip_fixture(tmp_path, {2: {"answer": ""}, 5: {"answer": None}})
    cfg = geo3k_config(prompt_data=path, rollout_shuffle=True)
    sizes = [3, 3, 3, 3, 3, 3, 3]
    uninterrupted = PromptDataset(cfg, processor, seed=3)
    expected = _draw(uninterrupted, sizes)

    first_part = PromptDataset(cfg, processor, seed=3)
    drawn = _draw(first_part, sizes[:3])
    state = json.loads(json.dumps(first_part.state_dict()))  # as a checkpoint stores it
    resumed = PromptDataset(cfg, processor, seed=3)
    resumed.load_state_dict(state)
    assert resumed.epoch == first_part.epoch and resumed.skip_counts == first_part.skip_counts
    drawn += _draw(resumed, sizes[3:])
    assert drawn == expected
    assert resumed.skip_counts == uninterrupted.skip_counts
    assert resumed.skip_counts["empty_label"] > 0 and resumed.epoch >= 2


def test_load_state_dict_rejects_other_dataset(processor):
    state = PromptDataset(geo3k_config(prompt_data=TEST), processor, seed=0).state_dict()
    other = PromptDataset(geo3k_config(prompt_data=TRAIN), processor, seed=0)
    with pytest.raises(DatasetError, match="has 64 rows but the checkpoint's data cursor was saved for 16"):
        other.load_state_dict(state)


def test_json_flags_name_the_flag(capsys):
    import argparse

    from slime.utils.config import add_group

    parser = argparse.ArgumentParser()
    add_group(parser, DataConfig, "data")
    with pytest.raises(SystemExit):
        parser.parse_args(["--multimodal-keys", "{image: images}"])
    assert "argument --multimodal-keys: expected a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--apply-chat-template-kwargs", "[1, 2]"])
    assert "argument --apply-chat-template-kwargs: expected a JSON object {...}, got '[1, 2]'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--multimodal-keys image must name a column"):
        DataConfig(multimodal_keys={"image": ""})
