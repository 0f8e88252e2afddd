"""The static walk of one rollout step (``scripts/tools/step_walk.py``): the README's core path is the walk's, file by
file and level by level, and the step stays readable (files entered, returns to a file, ``train_step``'s length).
The walker itself is checked on a made-up package whose walk is known by construction.  CPU only, imports nothing
it walks."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("fsdp", "megatron")
FILES_BELOW = 33
"""Files one step enters, below this (issue 31's bound): 31 for both backends after issue 31's reshaping
(``slime/ray/colocate.py``, ``fsdp/inputs.py`` and ``megatron/batches.py`` joined the files that called them)."""
RETURNS_AT_MOST = {"fsdp": 29, "megatron": 29}
"""Returns to a file already entered, at most (issue 31's bound, fewer than 30): 29 for both backends (52 / 59 before
issue 31's reshaping: one call into the GRPO corrections, the weight sync, the processor and the hand-over each, the
metrics from ``apply_update``, the reward function resolved once per worker; then the engines' memory released and
measured in one call, every sync ending with ``weights_updated``, the scorer's counts in the caller's
``RewardStats``, one log-ratio and one full-vocabulary log-prob call, R3's routes checked in ``StepRoutes.for_step``
and Megatron's replay around packed micro-batches in one call).  A change may lower them, not raise them."""


@pytest.fixture(scope="module")
def step_walk():
    spec = importlib.util.spec_from_file_location("step_walk", ROOT / "scripts" / "tools" / "step_walk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_walk"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("step_walk", None)


@pytest.fixture(scope="module")
def walks(step_walk):
    return {backend: step_walk.walk_step(backend) for backend in BACKENDS}


def _readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## What happens in one rollout step")
    return text[start:text.index("\n## ", start + 1)]


def _readme_table() -> dict[str, int]:
    rows = re.findall(r"^\| (\d+) \| `(slime/[\w/.]+)` \|", _readme_section(), flags=re.M)
    return {path: int(level) for level, path in rows}


def test_every_path_the_readme_step_names_exists():
    named = set(re.findall(r"`((?:slime|scripts|tests|docs)/[\w/.]+?)`", _readme_section()))
    assert named and not sorted(path for path in named if not (ROOT / path).exists())


def test_the_readme_core_path_is_every_file_a_step_enters_at_its_level(walks):
    walked: dict[str, int] = {}
    for walk in walks.values():
        files, _ = walk.summary()
        for path, level, _ in files:
            assert walked.setdefault(path, level) == level, f"{path} at two levels"
    table = _readme_table()
    assert table == walked, (f"in the walk, not in the README: {sorted(set(walked) - set(table))}; in the README, not "
                             f"in the walk: {sorted(set(table) - set(walked))}; levels differ: "
                             f"{sorted(p for p in table.keys() & walked.keys() if table[p] != walked[p])}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_step_enters_few_files_and_returns_no_more_often_than_now(walks, backend):
    files, returns = walks[backend].summary()
    assert len(files) < FILES_BELOW, [path for path, _, _ in files]
    assert returns <= RETURNS_AT_MOST[backend], [f"{path} {times}x" for path, _, times in files if times > 1]
    backend_files = {path for path, _, _ in files if path.startswith("slime/backends/")}
    assert "slime/backends/step.py" in backend_files and f"slime/backends/{backend}/backend.py" in backend_files


def test_train_step_fits_one_screen():
    tree = ast.parse((ROOT / "slime" / "backends" / "step.py").read_text())
    step = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train_step")
    assert step.end_lineno - step.lineno + 1 <= 80


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_walker_follows_calls_types_and_callbacks_and_counts_returns(step_walk, tmp_path):
    """A made-up ``slime`` package: the loop calls into ``a`` twice (one return), a typed attribute's method in ``b``
    (which calls back into ``a``: a second return), a callback handed to ``b``, a periodic function (left out) and a
    call inside ``raise`` (left out)."""
    _write(tmp_path, {
        "slime/__init__.py": "",
        "slime/driver.py": (
            "from slime import a\nfrom slime.b import Box, run\n"
            "def loop(box: Box):\n"
            "    a.first()\n    box.method()\n    run(a.callback)\n    a.second()\n    save()\n"
            "    if False:\n        raise ValueError(a.never())\n"
            "def save():\n    a.saved()\n"),
        "slime/a.py": ("def first(): pass\ndef second(): helper()\ndef helper(): pass\ndef callback(): pass\n"
                       "def never(): pass\ndef saved(): pass\ndef back(): pass\n"),
        "slime/b.py": ("from slime import a\nclass Box:\n    def method(self):\n        a.back()\n"
                       "def run(fn):\n    fn()\n"),
    })  # fmt: skip
    walk = step_walk.Walk(step_walk.Index(tmp_path), {}, skip=("slime.driver.save",))
    walk.run("slime.driver.loop")
    read = [name for _, name in walk.tree]
    assert read == ["slime.driver.loop", "slime.a.first", "slime.b.Box.method", "slime.a.back", "slime.b.run",
                    "slime.a.callback", "slime.a.second", "slime.a.helper"]
    files, returns = walk.summary()
    # entries: a (first), b (method), a (back, from b), b (run), a (callback), a (second): 6 entries, 3 files
    assert files == [("slime/driver.py", 0, 1), ("slime/a.py", 1, 4), ("slime/b.py", 1, 2)] and returns == 4
