"""A task the tiny policy can learn only by looking at the image.

Each prompt is a solid-colour image and the word ``colour``; the answer is the colour's
name, one word of a tiny word-level vocabulary (about 20 ids, so a uniformly random
policy names the right colour about 5 % of the time).  The prompt text is the same for
every colour, so on a batch that holds each colour equally often no text-only policy
scores more than 1/3 on average: whatever it says, it says it for every image.

This module stays light (no torch): the reward runs in the reward-scorer processes
(``--custom-rm-path scripts.harness.colour_task:colour_reward``).  Used by the CPU learning test
(:mod:`tests.test_learning`, ablations in :mod:`tests.learning_ablations`) and by the real-width GPU run
(``scripts/bench/colour_prior.py``, ``scripts/bench/h200_real_width.sh learn``).
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
VOCAB_WORDS = [*COLOURS, "colour"]
GREY = (128, 128, 128)
SINGLE_LETTER_ANSWERS = {"red": "r", "green": "g", "blue": "b"}
"""Answer words that any byte-level BPE tokenizer holds as one token each."""


def _png(rgb, size=64) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(buf, format="PNG")
    return buf.getvalue()


def write_colour_dataset(path, rows_per_colour: int = 4, answers: dict[str, str] | None = None) -> None:
    """Parquet with ``problem`` / ``answer`` / ``images`` columns (the geo3k schema).

    Rows go red, green, blue, repeated ``rows_per_colour`` times, so that without
    ``--rollout-shuffle`` any ``--rollout-batch-size`` that is a multiple of 3 holds every
    colour equally often, in that order.  ``answers``: each colour's answer word (default: its name); a
    tokenizer without one-token colour names (the scaled checkpoint's BPE) answers with
    :data:`SINGLE_LETTER_ANSWERS`.
    """
    answers = answers or {name: name for name in COLOURS}
    problems, labels, images = [], [], []
    for _ in range(rows_per_colour):
        for name, rgb in COLOURS.items():
            problems.append("<image>colour")
            labels.append(answers[name])
            images.append([{"bytes": _png(rgb), "path": None}])
    pq.write_table(pa.table({"problem": problems, "answer": labels, "images": images}), path)


def colour_reward(response: str, label: str, cfg) -> float:
    """1 if the response's first word is the label's colour, else 0 (``--custom-rm-path``)."""
    words = response.split()
    return 1.0 if words and words[0] == label else 0.0

