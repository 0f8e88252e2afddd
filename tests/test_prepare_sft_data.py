"""examples/geo3k_vlm/prepare_sft_data.py against the recipe README's SFT snippet.

The reference is the README's logic, re-typed here: ``Dataset.from_parquet`` ->
``.map(process_sample)`` (which adds ``messages``) -> ``.to_parquet``.  Both outputs are
compared row by row, every column, plus the parquet schema and its HF feature metadata.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCRIPT = os.path.join(REPO, "examples", "geo3k_vlm", "prepare_sft_data.py")
SAMPLE_DIR = os.path.join(REPO, "examples", "geo3k_vlm", "data")
SHARED_DIR = "/work/shared/data/geo3k"


def _load_script():
    spec = importlib.util.spec_from_file_location("prepare_sft_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _readme_reference(parquet_in: str, parquet_out: str) -> None:
    """The README snippet's steps, on a local parquet file instead of the hub."""
    ds = datasets.Dataset.from_parquet(parquet_in)

    def process_sample(sample):
        sample["messages"] = [
            {"role": "user", "content": sample["problem"]},
            {"role": "assistant", "content": "Answer: \\boxed{" + sample["answer"] + "}"},
        ]
        return sample

    ds.map(process_sample).to_parquet(parquet_out)


def _assert_same_parquet(ours: str, reference: str) -> None:
    a, b = pq.read_table(ours), pq.read_table(reference)
    assert a.schema.equals(b.schema, check_metadata=True)
    assert a.column_names == b.column_names
    assert "messages" in a.column_names
    rows_a, rows_b = a.to_pylist(), b.to_pylist()
    assert len(rows_a) == len(rows_b) > 0
    for k, (row_a, row_b) in enumerate(zip(rows_a, rows_b)):
        for column in a.column_names:
            assert row_a[column] == row_b[column], f"row {k}, column {column!r} differs"


@pytest.mark.parametrize("split, rows", [("train", 64), ("test", 16)])
def test_bundled_sample_matches_readme(tmp_path, split, rows):
    out, ref = tmp_path / "ours.parquet", tmp_path / "ref.parquet"
    assert _load_script().main(["--input", SAMPLE_DIR, "--split", split, "--output", str(out)]) == 0
    _readme_reference(os.path.join(SAMPLE_DIR, f"{split}.parquet"), str(ref))
    _assert_same_parquet(str(out), str(ref))
    assert pq.read_metadata(out).num_rows == rows


def test_shared_train_matches_readme(tmp_path):
    source = os.path.join(SHARED_DIR, "train.parquet")
    if not os.path.isfile(source):
        pytest.skip(f"{source} is not on this machine (only the team's machines have /work/shared)")
    out, ref = tmp_path / "ours.parquet", tmp_path / "ref.parquet"
    assert _load_script().main(["--input", source, "--output", str(out)]) == 0
    _readme_reference(source, str(ref))
    _assert_same_parquet(str(out), str(ref))


def test_messages_content_by_hand(tmp_path):
    out = tmp_path / "nested" / "sft.parquet"  # the folder is created
    _load_script().main(["--input", os.path.join(SAMPLE_DIR, "test.parquet"), "--output", str(out)])
    source = pq.read_table(os.path.join(SAMPLE_DIR, "test.parquet")).to_pylist()
    written = datasets.Dataset.from_parquet(str(out))
    assert isinstance(written.features["images"], datasets.List)
    assert isinstance(written.features["images"].feature, datasets.Image)
    first = pq.read_table(out).to_pylist()[0]
    assert first["messages"] == [
        {"role": "user", "content": source[0]["problem"]},
        {"role": "assistant", "content": "Answer: \\boxed{" + source[0]["answer"] + "}"},
    ]
    assert first["images"] == source[0]["images"]  # bytes passed through, not re-encoded


def test_hub_input_calls_load_dataset(tmp_path, monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_parquet(os.path.join(SAMPLE_DIR, "test.parquet"))

    module = _load_script()
    monkeypatch.setattr(module.datasets, "load_dataset", fake_load_dataset)
    module.main(["--input", "chenhegu/geo3k_imgurl", "--split", "test", "--output", str(tmp_path / "a.parquet")])
    module.main(["--input", "chenhegu/geo3k_imgurl@validation", "--output", str(tmp_path / "b.parquet")])
    assert calls == [("chenhegu/geo3k_imgurl", "test"), ("chenhegu/geo3k_imgurl", "validation")]
    assert pq.read_metadata(tmp_path / "a.parquet").num_rows == 16


def test_missing_file_and_column(tmp_path, capsys):
    module = _load_script()
    with pytest.raises(SystemExit):
        module.main(["--input", str(tmp_path / "nope.parquet"), "--output", str(tmp_path / "o.parquet")])
    err = capsys.readouterr().err
    assert "--input" in err and "nope.parquet" in err and "file not found" in err
    with pytest.raises(SystemExit):
        module.main(["--input", SAMPLE_DIR, "--answer-key", "solution", "--output", str(tmp_path / "o.parquet")])
    err = capsys.readouterr().err
    assert "--answer-key 'solution'" in err and "'answer'" in err
    assert not (tmp_path / "o.parquet").exists()


def test_cli_help():
    env = dict(os.environ, PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--input", "--split", "--output"):
        assert option in result.stdout


# ----------------------------------------------------------------------------- bad input


def _run_expecting_error(module, capsys, *argv: str) -> str:
    """main(argv) must stop with a usage error; returns its stderr."""
    with pytest.raises(SystemExit) as info:
        module.main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


def test_bad_answers_are_an_error_naming_the_rows(tmp_path, capsys):
    rows = pq.read_table(os.path.join(SAMPLE_DIR, "train.parquet")).to_pylist()
    blank = {2: "", 5: None, 9: "  ", 13: "\n"}
    for position, answer in blank.items():
        rows[position]["answer"] = answer
    rows[20]["problem"] = None
    source = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(os.path.join(SAMPLE_DIR, "train.parquet"))), source)
    out = tmp_path / "o.parquet"

    err = _run_expecting_error(_load_script(), capsys, "--input", str(source), "--output", str(out))
    assert f"--input {str(source)!r}: 5 of 64 rows cannot be formatted" in err
    for position, answer in blank.items():
        assert f"row {position} (id {rows[position]['id']}): --answer-key 'answer' is {answer!r}" in err
    assert f"row 20 (id {rows[20]['id']}): --problem-key 'problem' is None, not text" in err
    assert "row 0 " not in err and not out.exists()


def test_more_than_ten_bad_rows_are_counted(tmp_path, capsys):
    lines = [{"id": f"r{k}", "problem": f"<image>Find x{k}.", "answer": "" if k % 2 else "1"} for k in range(30)]
    source = tmp_path / "many.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    err = _run_expecting_error(_load_script(), capsys, "--input", str(source), "--output", str(tmp_path / "o.parquet"))
    listed = "; ".join(f"row {k} (id r{k}): --answer-key 'answer' is ''" for k in range(1, 21, 2))  # the first 10
    assert f"15 of 30 rows cannot be formatted: {listed}; and 5 more." in err


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("zero_bytes.parquet", b"", r"zero_bytes\.parquet is not a readable parquet file"),
        ("garbage.parquet", b"not parquet at all", r"garbage\.parquet is not a readable parquet file"),
        ("no_rows.parquet", None, r"no_rows\.parquet has no rows"),
        ("empty.jsonl", b"\n\n", r"empty\.jsonl has no rows"),
        ("broken.jsonl", b'{"problem": "a", "answer": "1"}\n{"problem": \n', r"broken\.jsonl line 2: invalid JSON"),
        ("list.jsonl", b'{"problem": "a", "answer": "1"}\n\n[1, 2]\n', r"list\.jsonl line 3: expected a JSON object"),
    ],
)
def test_unreadable_or_empty_input_names_the_file(tmp_path, capsys, name, content, expected):
    source = tmp_path / name
    if content is None:  # a valid parquet file with the sample's schema and no rows
        pq.write_table(pq.read_table(os.path.join(SAMPLE_DIR, "test.parquet")).slice(0, 0), source)
    else:
        source.write_bytes(content)
    err = _run_expecting_error(_load_script(), capsys, "--input", str(source), "--output", str(tmp_path / "o.parquet"))
    assert re.search(r"--input '.*" + expected, err), err
    assert not (tmp_path / "o.parquet").exists()


def test_jsonl_input_keeps_answers_as_written(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text(
        '{"problem": "<image>A", "answer": 3, "images": ["a.png"]}\n'
        '{"problem": "<image>B", "answer": 3.5, "images": ["b.png"]}\n'
        '{"problem": "<image>C", "answer": "3", "images": ["c.png"]}\n'
        '{"problem": "<image>D", "answer": 1e-3, "images": ["d.png"]}\n'
    )
    out = tmp_path / "sft.parquet"
    assert _load_script().main(["--input", str(source), "--output", str(out)]) == 0
    written = pq.read_table(out).to_pylist()
    assert [row["messages"][1]["content"] for row in written] == [
        "Answer: \\boxed{3}", "Answer: \\boxed{3.5}", "Answer: \\boxed{3}", "Answer: \\boxed{1e-3}",
    ]  # fmt: skip
    assert [row["messages"][0]["content"] for row in written] == ["<image>A", "<image>B", "<image>C", "<image>D"]
    assert [row["images"] for row in written] == [["a.png"], ["b.png"], ["c.png"], ["d.png"]]


@pytest.mark.parametrize("output", ["x.csv", "x.parquet.json", "x"])
def test_output_must_be_parquet(tmp_path, capsys, output):
    err = _run_expecting_error(
        _load_script(), capsys, "--input", SAMPLE_DIR, "--split", "test", "--output", str(tmp_path / output)
    )
    assert f"--output {str(tmp_path / output)!r}" in err and "ending in .parquet" in err
    assert list(tmp_path.iterdir()) == []
