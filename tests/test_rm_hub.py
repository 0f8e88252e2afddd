"""Tests of slime.rollout.rm_hub: answer extraction, the math / deepscaler / geo3k rewards,
custom reward functions, the process-pool scorer (timeouts, kills, worker deaths) and the CLI.

Expected rewards are worked out by hand from the reward definitions, or, for the Geometry3K
rows, from the float64 value of each label computed by a small LaTeX-to-SymPy converter
written here (independent of math-verify).  CPU-only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import types
from concurrent.futures.process import BrokenProcessPool
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pandas as pd
import pytest
from math_verify import parse
from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

from slime.rollout.rm_hub.answer import answer_alternatives, last_boxed, numeric_value, parse_latex, unwrap_math_text
from slime.rollout.rm_hub.config import REWARD_FUNCTIONS, RewardConfig, resolve_reward_function
from slime.rollout.rm_hub.deepscaler import deepscaler_reward
from slime.rollout.rm_hub.geo3k import decimal_places, geo3k_reward
from slime.rollout.rm_hub.math_reward import EmptyLabelError, math_reward
from slime.rollout.rm_hub.scorer import RewardScorer, RewardStats
from slime.utils.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
GEO3K_SAMPLE = REPO / "examples" / "geo3k_vlm" / "data"
MATH = RewardConfig(rm_type="math")
GEO3K = RewardConfig(rm_type="geo3k")
GEO3K_STRICT = RewardConfig(rm_type="geo3k", rm_tolerance=0.0)
DEEPSCALER = RewardConfig(rm_type="deepscaler")


@pytest.fixture(scope="module")
def scorers():
    """``scorers(cfg)``: the module's scorer for the reward flags ``cfg``, with 2 workers, started on first
    use and shared by the tests that use the same flags (a scorer scores with its own flags only)."""
    pools: dict[str, RewardScorer] = {}

    def scorer_for(cfg: RewardConfig) -> RewardScorer:
        key = repr(cfg)
        if key not in pools:
            pools[key] = RewardScorer(dataclasses.replace(cfg, rm_num_workers=2))
            pools[key].score([], [])  # starts the workers, so that no test times their start-up
        return pools[key]

    yield scorer_for
    for pool in pools.values():
        pool.close()


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"\boxed{a_{b_{c}}} done", r"a_{b_{c}}"),
        (r"first \boxed{3}, then \boxed{5}", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{1} and \fbox{2}", "2"),
        (r"\boxed {42}", "42"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\boxed{9}}", "9"),
        ("The answer is 5.", None),
        ("", None),
        (r"\boxed{3} but then \boxed{4", None),  # the last box was cut off: no answer
        (r"\boxed 5", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_unwrapped_math_verify_reads_only_the_leading_number_so_answers_are_wrapped():
    # The fact that makes the $...$ wrapping necessary (math-verify 0.9.0):
    unwrapped = parse(r"8\sqrt{3}", parsing_timeout=None)
    assert float(unwrapped[0]) == 8.0
    # The wrapped parse is used for gold labels and boxed predictions alike.
    assert float(parse_latex(r"8\sqrt{3}")[0]) == pytest.approx(8 * math.sqrt(3), rel=1e-15)
    # Gold side: a bare "8" must not match label 8\sqrt{3}.  Prediction side: a boxed
    # 8\sqrt{3} must not match label 8.  Both would be 1.0 without the wrapping.
    assert math_reward(r"\boxed{8}", r"8\sqrt{3}", MATH) == 0.0
    assert math_reward(r"\boxed{8\sqrt{3}}", "8", MATH) == 0.0


@pytest.mark.parametrize(
    "answer, expected",
    [
        (r"8\sqrt{3}", 8 * math.sqrt(3)),
        (r"\frac{5}{3}\pi", 5 / 3 * math.pi),
        ("129.9", 129.9),
        (r"60^\circ", 60.0),
        ("x = 12", 12.0),
        ("-2.5", -2.5),
        ("x", None),
        (r"\{1, 2\}", None),
        (r"\sqrt{-1}", None),
        ("1000!", None),  # ~4e2567: not a finite float
    ],
)
def test_numeric_value(answer, expected):
    value = numeric_value(parse_latex(answer))
    if expected is None:
        assert value is None
    else:
        assert value == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- math reward


@pytest.mark.parametrize(
    "response, label, expected",
    [
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{40}{3}}", r"\frac{40}{3}", 1.0),
        (r"\boxed{13\frac{1}{3}}", r"\frac{40}{3}", 1.0),
        (r"\boxed{\frac{40}{3}}", r"\frac{41}{3}", 0.0),
        (r"\boxed{60^\circ}", "60", 1.0),
        (r"\boxed{60^{\circ}}", "60", 1.0),
        (r"\boxed{60°}", "60", 1.0),
        (r"\boxed{61^\circ}", "60", 0.0),
        (r"\boxed{\frac{5\pi}{3}}", r"\frac{5}{3}\pi", 1.0),
        (r"\boxed{\frac{5}{3}}", r"\frac{5}{3}\pi", 0.0),
        (r"\boxed{5.236}", r"\frac{5}{3}\pi", 0.0),  # 5.235987...: decimals are compared to 6 places
        (r"\boxed{5\sqrt{3}}", r"5\sqrt{3}", 1.0),
        (r"\boxed{\sqrt{75}}", r"5\sqrt{3}", 1.0),
        (r"\boxed{5\sqrt{2}}", r"5\sqrt{3}", 0.0),
        (r"\boxed{129.9}", "129.9", 1.0),
        (r"\boxed{129.90}", "129.9", 1.0),
        (r"\boxed{129.904}", "129.9", 0.0),
        (r"\boxed{13.86}", r"8\sqrt{3}", 0.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"The length is \boxed{12} units.", "12", 1.0),
        (r"\fbox{7}", "7", 1.0),
        (r"\boxed{3} ... on reflection \boxed{5}", "5", 1.0),
        (r"\boxed{3} ... on reflection \boxed{5}", "3", 0.0),
        (r"\boxed{5} ... wait, \boxed{", "5", 0.0),
        ("The answer is 5.", "5", 0.0),
        ("", "5", 0.0),
        ("}{ \\ $$ ^^ \\frac{", "5", 0.0),
        (r"\boxed{}", "5", 0.0),
        (r"\boxed{C}", "5", 0.0),
    ],
)
def test_math_reward_hand_cases(response, label, expected):
    assert math_reward(response, label, MATH) == expected


@pytest.mark.parametrize(
    "response, label, expected",
    [
        # Issue 12: a decimal or an expression wrapped in \text{} (integers already passed).
        (r"\boxed{\text{12.6}}", "12.6", 1.0),
        (r"\boxed{\text{4\sqrt{3}}}", r"4\sqrt{3}", 1.0),
        (r"\boxed{\text{12.6 cm}}", "12.6", 1.0),
        (r"\boxed{\text{ 12.6 }}", "12.6", 1.0),
        (r"\boxed{\textrm{12.6}}", "12.6", 1.0),
        (r"\boxed{\mbox{12.6}}", "12.6", 1.0),
        (r"\boxed{\text{12}}", "12", 1.0),
        (r"\boxed{\text{x = 12.6}}", "12.6", 1.0),
        (r"\boxed{\text{12.6}}", "12.5", 0.0),  # unwrapped, then graded: still wrong
        (r"\boxed{\text{4\sqrt{3}}}", r"3\sqrt{4}", 0.0),
        # Hedges stay hedges: two values never score, wrapped or not.
        (r"\boxed{71 \text{ or } 33}", "71", 0.0),
        (r"\boxed{71 \text{ or } 33}", "33", 0.0),
        (r"\boxed{\text{71 or 33}}", "71", 0.0),
        (r"\boxed{\text{71} \text{ or } \text{33}}", "71", 0.0),
        (r"\boxed{\text{12.6 or 13}}", "12.6", 0.0),
        (r"\boxed{\text{12.6 and 13}}", "13", 0.0),
        # Words and letters are not unwrapped.
        (r"\boxed{\text{twelve}}", "12", 0.0),
        (r"\boxed{\text{C}}", "5", 0.0),
    ],
)
def test_text_wrapped_math_is_graded_as_math_without_opening_hedges(response, label, expected):
    assert math_reward(response, label, MATH) == expected
    assert geo3k_reward(response, label, GEO3K) == expected


@pytest.mark.parametrize(
    "response, label, expected",
    [
        # Hedges between values with units: math-verify alone reads only the first value (12).
        (r"\boxed{12\text{ cm} \text{ or } 13\text{ cm}}", "12", 0.0),
        (r"\boxed{12\text{ cm} \text{ or } 13\text{ cm}}", "13", 0.0),
        (r"\boxed{12\text{ cm} \text{ or } 13\text{ cm}}", "12.0", 0.0),  # nor by geo3k's tolerance
        (r"\boxed{12 \text{ cm or } 13 \text{ cm}}", "12", 0.0),
        (r"\boxed{\text{12 cm or 13 cm}}", "12", 0.0),
        (r"\boxed{12\text{ cm}, 13\text{ cm}}", "12", 0.0),
        (r"\boxed{12\text{ cm and }13\text{ cm}}", "13", 0.0),
        (r"\boxed{12^\circ \text{ or } 13^\circ}", "12", 0.0),
        (r"\boxed{x = 12 \text{ or } x = 13}", "12", 0.0),
        (r"\boxed{12 \text{ (or 13)}}", "13", 0.0),
        (r"\boxed{12 \text{ or more}}", "12", 0.0),  # an alternative that is not a value
        # Not hedges: the same value twice, a set against a set label, values that hold a comma.
        (r"\boxed{12 \text{ cm or } 12 \text{ cm}}", "12", 1.0),
        (r"\boxed{3 \text{ and } 2}", "2, 3", 1.0),
        (r"\boxed{2, 3}", "2, 3", 1.0),
        (r"\boxed{2\text{ cm}, 3\text{ cm}}", "2, 3", 1.0),
        (r"\boxed{2, 4}", "2, 3", 0.0),
        (r"\boxed{(3, 4)}", "(3, 4)", 1.0),
        (r"\boxed{1,200}", "1200", 1.0),
        (r"\boxed{\text{12.6 cm}}", "12.6", 1.0),
    ],
)
def test_hedges_with_units_score_zero(response, label, expected):
    assert math_reward(response, label, MATH) == expected
    assert geo3k_reward(response, label, GEO3K) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        (r"12\text{ cm} \text{ or } 13\text{ cm}", [r"12\text{ cm}", r"13\text{ cm}"]),
        (r"12 \text{ cm or } 13 \text{ cm}", [r"12 \text{ cm }", r"13 \text{ cm}"]),
        (r"\text{12 cm or 13 cm}", [r"\text{12 cm }", r"\text{ 13 cm}"]),
        (r"12, 13", ["12", "13"]),
        (r"12 or 13 and 14", ["12", "13", "14"]),
        (r"x = 12 \text{ or } x = 13", ["x = 12", "x = 13"]),
        (r"12.6\text{ cm}", None),
        (r"(3, 4)", None),
        (r"\left(3, 4\right)", None),
        (r"[1, 2)", None),
        (r"\{1, 2\}", None),
        (r"1,200", None),
        (r"1,234,567", None),
        (r"\text{1,200 cm}", None),
        (r"\frac{\text{a or b}}{2}", None),  # inside a group
        (r"\operatorname{cor} 5", None),  # a word that contains "or"
        (r"12, ", None),  # one value
    ],
)
def test_answer_alternatives(answer, expected):
    assert answer_alternatives(answer) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        (r"\text{12.6}", "12.6"),
        (r"\text{12.6 cm}", "12.6 cm"),
        (r"12.6\text{ cm}", r"12.6\text{ cm}"),  # a unit word: math-verify strips it itself
        (r"71 \text{ or } 33", r"71 \text{ or } 33"),
        (r"\text{71 or 33}", r"\text{71 or 33}"),  # a set of two values is not one expression
        (r"2 + \text{4\sqrt{3}} - 1", r"2 + 4\sqrt{3} - 1"),
        (r"\text{C}", r"\text{C}"),
        (r"\text{}", r"\text{}"),
        (r"\text{12.6", r"\text{12.6"),  # never closed
        ("no text", "no text"),
    ],
)
def test_unwrap_math_text(answer, expected):
    assert unwrap_math_text(answer) == expected


@pytest.mark.parametrize("label", ["", "   "])
def test_empty_label_raises(label):
    for reward in (math_reward, geo3k_reward, deepscaler_reward):
        with pytest.raises(EmptyLabelError, match="label .* is empty"):
            reward("no think, no box", label, GEO3K)


# ----------------------------------------------------------------------------- deepscaler reward


@pytest.mark.parametrize(
    "response, expected",
    [
        (r"<think>4 + 1</think> The answer is \boxed{5}.", 1.0),
        (r"<think>4 + 1</think> The answer is \boxed{6}.", 0.0),
        (r"<think>4 + 1 ... \boxed{5}</think> so five.", 0.0),  # the box is inside the thinking
        (r"\boxed{5}", 0.0),  # right answer, but the thinking never ended
        (r"<think>4 + 1 ... \boxed{5}", 0.0),  # cut off inside the thinking
        (r"<think>a</think> \boxed{6} <think>b</think> \boxed{5}", 1.0),  # after the last marker
    ],
)
def test_deepscaler_reward(response, expected):
    assert deepscaler_reward(response, "5", DEEPSCALER) == expected


# ----------------------------------------------------------------------------- geo3k reward


def test_geo3k_tolerance_accepts_rounded_decimal_that_math_rejects():
    # 8*sqrt(3) = 13.8564...; |13.86 - 13.8564| / 13.8564 = 2.6e-4 <= 0.05.
    assert geo3k_reward(r"\boxed{13.86}", r"8\sqrt{3}", GEO3K) == 1.0
    assert geo3k_reward(r"\boxed{8\sqrt{3}}", "13.86", GEO3K) == 1.0
    assert math_reward(r"\boxed{13.86}", r"8\sqrt{3}", MATH) == 0.0
    assert math_reward(r"\boxed{8\sqrt{3}}", "13.86", MATH) == 0.0
    assert geo3k_reward(r"\boxed{13.86}", r"8\sqrt{3}", GEO3K_STRICT) == 0.0
    assert geo3k_reward(r"\boxed{8\sqrt{3}}", "13.86", GEO3K_STRICT) == 0.0
    # and the other way round: label 129.9 rounds 75*sqrt(3) = 129.9038...
    assert geo3k_reward(r"\boxed{75\sqrt{3}}", "129.9", GEO3K) == 1.0
    assert math_reward(r"\boxed{75\sqrt{3}}", "129.9", MATH) == 0.0


@pytest.mark.parametrize(
    "answer, places",
    [
        ("13.86", 2),
        ("48.0", 1),
        ("-2.5", 1),
        (".5", 1),
        ("129.904", 3),
        ("14", 0),
        (r"8\sqrt{3}", 0),
        (r"\frac{40}{3}", 0),
        (r"\frac{5}{3}\pi", 0),
        (r"60^\circ", 0),
        (r"60.5^{\circ}", 1),
        ("x = 14.1", 1),
        (r"14.1\text{ cm}", 1),
        (r"2\cdot 7.05", 2),
        ("1,200.5", 1),
    ],
)
def test_decimal_places(answer, places):
    assert decimal_places(answer) == places


@pytest.mark.parametrize(
    "response, label, expected",
    [
        # Same decimal places (both integers, or both decimals with k digits): math only.
        # The reviewer's cases: Geometry3K distractors within 5 % of the right option.
        (r"\boxed{94}", "96", 0.0),
        (r"\boxed{98}", "96", 0.0),
        (r"\boxed{100}", "96", 0.0),
        (r"\boxed{96}", "98", 0.0),
        (r"\boxed{110}", "105", 0.0),
        (r"\boxed{105}", "110", 0.0),
        (r"\boxed{14.1}", "14.6", 0.0),
        (r"\boxed{15.1}", "14.6", 0.0),
        (r"\boxed{14.6}", "14.1", 0.0),
        (r"\boxed{48.0}", "50.2", 0.0),  # a trailing zero is a written decimal place
        (r"\boxed{50.2}", "48.0", 0.0),
        (r"\boxed{6.78}", "6.79", 0.0),
        (r"\boxed{x = 14.1}", "14.6", 0.0),  # decorations do not make a decimal "exact"
        (r"\boxed{14.1\text{ cm}}", "14.6", 0.0),
        (r"\boxed{96}", "96", 1.0),
        (r"\boxed{14.6}", "14.6", 1.0),
        (r"\boxed{x = 14.6}", "14.6", 1.0),
        # No decimals on either side (integers, exact expressions): math only.
        (r"\boxed{14}", r"8\sqrt{3}", 0.0),  # 13.856...: the reviewer's repro
        (r"\boxed{8\sqrt{3}}", "14", 0.0),
        (r"\boxed{13}", r"\frac{40}{3}", 0.0),
        (r"\boxed{\frac{40}{3}}", "13", 0.0),
        (r"\boxed{\sqrt{190}}", r"8\sqrt{3}", 0.0),  # 13.78
        (r"\boxed{\sqrt{10}}", r"\sqrt{11}", 0.0),
        (r"\boxed{61^\circ}", "60", 0.0),
        (r"\boxed{60^\circ}", "60", 1.0),
        (r"\boxed{\sqrt{192}}", r"8\sqrt{3}", 1.0),
        # Different decimal places: one side is a rounded decimal, so the tolerance applies.
        (r"\boxed{13.86}", r"8\sqrt{3}", 1.0),
        (r"\boxed{8\sqrt{3}}", "13.86", 1.0),
        (r"\boxed{x = 13.86}", r"8\sqrt{3}", 1.0),
        (r"\boxed{13.86^\circ}", r"8\sqrt{3}", 1.0),
        (r"\boxed{13.9}", r"8\sqrt{3}", 1.0),  # 13.856 rounds to 13.9: |error| 0.044 <= 0.05
        (r"\boxed{13.8}", r"8\sqrt{3}", 0.0),  # within 5 %, but 0.056 > half a unit (0.05)
        (r"\boxed{75\sqrt{3}}", "129.9", 1.0),
        (r"\boxed{129.9}", r"75\sqrt{3}", 1.0),
        (r"\boxed{129.904}", "129.9", 1.0),
        (r"\boxed{129.9}", "129.904", 0.0),  # coarser than the label asks: 0.004 > 0.0005
        (r"\boxed{6.8}", "6.79", 0.0),  # likewise: 0.01 > 0.005
        (r"\boxed{6.79}", "6.8", 1.0),
        (r"\boxed{15}", "14.6", 0.0),  # dropping digits does not buy a tolerance (15.1 is a choice)
        (r"\boxed{13}", "12.7", 0.0),
        (r"\boxed{130}", "129.9", 0.0),
        # An expression with a decimal in it is not a rounding of an exact label.
        (r"\boxed{14\cdot1.0}", r"8\sqrt{3}", 0.0),
        (r"\boxed{8.1\sqrt{3}}", r"8\sqrt{3}", 0.0),
        (r"\boxed{8\sqrt{3}+0.004}", r"8\sqrt{3}", 0.0),
        (r"\boxed{13.1\cdot1}", r"\frac{40}{3}", 0.0),
        (r"\boxed{13.3}", r"\frac{40}{3}", 1.0),
        (r"\boxed{\frac{5}{3}\pi}", "5.24", 1.0),
        (r"\boxed{5.24}", r"\frac{5}{3}\pi", 1.0),
        (r"\boxed{14.6}", r"8\sqrt{3}", 0.0),  # 5.4 % off: outside the tolerance
        (r"\boxed{8\sqrt{3}}", "14.6", 0.0),
        (r"\boxed{x}", "13.86", 0.0),  # not a number
        # 9 is what 8.6 rounds to, but the label asks for tenths (Geometry3K row 715: 9 is a wrong choice).
        (r"\boxed{9}", "8.6", 0.0),
        # Accepted at the edge, by design: 11.5 and 12.5 lie exactly half a unit from 12 (row 2516).
        (r"\boxed{11.5}", "12", 1.0),
        (r"\boxed{12.5}", "12", 1.0),
        (r"\boxed{12.6}", "12", 0.0),
        # More digits do not buy the 5 %: the error must also be within half a unit of the coarser
        # plain number (the reviewer's repro 14.5, and distractors written with an extra 0).
        (r"\boxed{14.5}", r"8\sqrt{3}", 0.0),  # 4.6 % off, but 0.64 > 0.05
        (r"\boxed{94.0}", "96", 0.0),  # 2 > 0.5
        (r"\boxed{36.0}", "37", 0.0),  # 1 > 0.5
        (r"\boxed{96.4}", "96", 1.0),  # 96.4 rounds to 96
        (r"\boxed{14.10}", "14.6", 0.0),  # 0.5 > 0.05
        (r"\boxed{14.63}", "14.6", 1.0),
    ],
)
def test_geo3k_tolerance_only_between_different_precisions(response, label, expected):
    assert geo3k_reward(response, label, GEO3K) == expected
    assert geo3k_reward(response, label, GEO3K_STRICT) == math_reward(response, label, MATH)


@pytest.mark.parametrize(
    "response, label, tolerance, expected",
    [
        # 5/6 = 0.8333 vs 0.8: 4.2 % off, within half a unit (0.05) of 0.8, so the relative bound decides.
        (r"\boxed{\frac{5}{6}}", "0.8", 0.05, 1.0),
        (r"\boxed{\frac{5}{6}}", "0.8", 0.04, 0.0),
        (r"\boxed{\frac{5}{6}}", "0.8", 0.0, 0.0),
        (r"\boxed{-\frac{5}{6}}", "-0.8", 0.05, 1.0),  # |g| in the bound
        (r"\boxed{\frac{5}{6}}", "-0.8", 0.05, 0.0),
        (r"\boxed{100.4}", "100", 0.05, 1.0),  # 0.4 % off, within 0.5
        (r"\boxed{100.6}", "100", 0.05, 0.0),  # 0.6 % off, but 0.6 > 0.5
        (r"\boxed{100.4}", "100", 0.001, 0.0),  # 0.4 % > 0.1 %
        (r"\boxed{109}", "100", 0.1, 0.0),  # two integers: never a tolerance
        (r"\boxed{100.001}", "100", 0.0, 0.0),
        (r"\boxed{0.001}", "0", 0.05, 0.0),  # g = 0 needs p = 0
        (r"\boxed{0.0}", "0", 0.05, 1.0),
        (r"\boxed{0}", "0", 0.05, 1.0),
        (r"\boxed{x}", "5.5", 0.05, 0.0),  # not a number
        (r"\boxed{\{5.5, 6\}}", "5", 0.05, 0.0),
        ("5.0 without a box", "5", 0.05, 0.0),
    ],
)
def test_geo3k_relative_tolerance(response, label, tolerance, expected):
    assert geo3k_reward(response, label, RewardConfig(rm_type="geo3k", rm_tolerance=tolerance)) == expected


@pytest.mark.parametrize(
    "response, label",
    [
        (r"\boxed{13.86}", r"8\sqrt{3}"),
        (r"\boxed{13.856406}", r"8\sqrt{3}"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{60^\circ}", "60"),
        (r"\boxed{129.904}", "129.9"),
        (r"\boxed{14.5}", r"8\sqrt{3}"),
        (r"\boxed{3} \boxed{5}", "5"),
        ("no box", "5"),
    ],
)
def test_geo3k_with_zero_tolerance_is_math(response, label):
    assert geo3k_reward(response, label, GEO3K_STRICT) == math_reward(response, label, MATH)


# ----------------------------------------------------------------------------- Geometry3K rows


def _latex_to_float(latex: str) -> float:
    """float64 value of a Geometry3K compact answer (``5\\sqrt{3}``, ``\\frac{17\\sqrt{2}}{2}``, ...),
    via SymPy's Python-syntax parser: an independent reference for math-verify's LaTeX parse."""
    text = re.sub(r"\\sqrt(\d)", r"sqrt(\1)", latex)
    while True:
        rewritten = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", text)
        rewritten = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", rewritten)
        if rewritten == text:
            break
        text = rewritten
    text = text.replace(r"\pi", " pi ")
    if "\\" in text or "{" in text:
        raise ValueError(f"the test converter does not handle {latex!r} (got {text!r})")
    return float(parse_expr(text, transformations=standard_transformations + (implicit_multiplication_application,)))


def _written_places(answer: str) -> tuple[int, bool]:
    """(decimal places, whether a plain number) of a Geometry3K compact answer, by Python's
    ``decimal`` (independent of ``decimal_places``): a plain literal's fractional digits;
    (0, False) for an exact expression."""
    try:
        return -min(Decimal(answer).as_tuple().exponent, 0), True
    except InvalidOperation:
        assert "." not in answer, answer  # every compact non-literal in the sample is exact
        return 0, False


def _expected_geo3k(choice: str, answer: str, tol: float = 0.05) -> float:
    """The geo3k rule, worked out with the test's own converters: equal; or at different
    precision, within ``tol`` relative and half a unit of the rounded side (the answer if
    it is a plain number, else the choice if it is)."""
    gold = _latex_to_float(answer)
    error = abs(_latex_to_float(choice) - gold)
    if error <= 1e-9 * abs(gold):
        return 1.0
    (choice_places, choice_plain), (answer_places, answer_plain) = _written_places(choice), _written_places(answer)
    if choice_places == answer_places:
        return 0.0
    if answer_plain:  # the rounded side: the label if plain, else the choice if plain
        places = answer_places
    elif choice_plain:
        places = choice_places
    else:
        return 0.0
    return 1.0 if error <= tol * abs(gold) and error <= 0.5 * 10.0**-places * (1 + 1e-9) else 0.0


def _geo3k_rows() -> pd.DataFrame:
    paths = [GEO3K_SAMPLE / "train.parquet", GEO3K_SAMPLE / "test.parquet"]
    if not all(path.exists() for path in paths):
        pytest.skip(f"bundled Geometry3K sample missing: {paths}")
    columns = ["id", "answer", "choices", "answer_letter"]
    return pd.concat([pd.read_parquet(path, columns=columns) for path in paths])


def test_geo3k_rows_answer_scores_1_and_no_wrong_choice_scores_1(scorers):
    """Every row's answer scores 1; every other choice scores 0 under geo3k, near ones included.

    The expected reward of each wrong choice comes from the rule worked out independently
    (:func:`_expected_geo3k`: ``_latex_to_float`` and ``_written_places``, not math-verify
    or ``decimal_places``).  In the bundled sample no wrong choice meets it, so all score
    0, including the nine that lie within 5 % of the answer, which a plain relative
    tolerance accepts (label 96 with choices 94, 98, 100; 14.6 with 14.1, 15.1; 105 with
    110; ...), and the same choices written with one more digit (``94.0``, ``14.10``) or
    rounded to a whole number (``15`` for choice 15.1, label 14.6), which would otherwise
    buy the tolerance.  The team's 400-row copy has two that meet
    it by design (12 vs 11.5 and 12.5, half a unit away: see
    ``test_geo3k_tolerance_only_between_different_precisions``).
    """
    rows = _geo3k_rows()
    responses, labels, expected, near, accepted = [], [], [], [], []
    for row_id, answer, choices, letter in zip(rows["id"], rows["answer"], rows["choices"], rows["answer_letter"]):
        assert choices["ABCD".index(letter)] == answer
        gold = _latex_to_float(answer)
        responses.append(rf"<think>...</think> The answer is \boxed{{{answer}}}.")
        labels.append(answer)
        expected.append(1.0)
        for index, choice in enumerate(choices):
            if index == "ABCD".index(letter):
                continue
            error = abs(_latex_to_float(choice) - gold)
            if 0 < error <= 0.05 * abs(gold):
                near.append((row_id, answer, choice))
            variants = []  # the same wrong value with more digits, and rounded to a whole number
            if _written_places(choice)[1]:
                variants.append(choice + ("0" if "." in choice else ".0"))
                if "." in choice:
                    variants.append(str(round(float(choice))))
            for written in [choice, *variants]:
                reward = _expected_geo3k(written, answer)
                accepted += [(row_id, answer, written)] if reward else []
                responses.append(rf"\boxed{{{written}}}")
                labels.append(answer)
                expected.append(reward)
    assert accepted == []
    assert expected.count(0.0) > 3 * len(rows) > 0  # the check is not vacuous
    assert len(near) == 9 and (539, "96", "98") in near and (1315, "14.6", "14.1") in near

    geo3k, math_scorer = scorers(GEO3K), scorers(MATH)
    geo3k_stats, math_stats = RewardStats(), RewardStats()
    assert geo3k.score(responses, labels, geo3k_stats) == expected
    assert math_scorer.score(responses, labels, math_stats) == expected
    assert geo3k_stats.failed == 0 and math_stats.failed == 0
    assert _expected_geo3k("94.0", "96") == 0.0 and _expected_geo3k("13.86", r"8\sqrt{3}") == 1.0  # the rule itself
    answers_only = [r for r, e in zip(responses, expected) if e == 1.0]
    assert scorers(DEEPSCALER).score(answers_only, list(rows["answer"])) == [1.0] * len(rows)


def test_geo3k_rows_two_decimal_rounding_within_tolerance(scorers):
    rows = _geo3k_rows()
    responses, expected = [], []
    for answer in rows["answer"]:
        gold = _latex_to_float(answer)
        rounded = round(gold, 2)
        responses.append(rf"\boxed{{{rounded:.2f}}}")
        expected.append(1.0 if abs(rounded - gold) <= 0.05 * abs(gold) else 0.0)
    assert scorers(GEO3K).score(responses, list(rows["answer"])) == expected


# ----------------------------------------------------------------------------- registry and flags


def test_registry_lists_builtin_rewards():
    assert {"math", "deepscaler", "geo3k"} <= set(REWARD_FUNCTIONS.names())
    assert "math" in REWARD_FUNCTIONS and "my_pkg.rewards:score" in REWARD_FUNCTIONS
    assert "nonexistent" not in REWARD_FUNCTIONS
    assert RewardConfig().rm_type == "math"
    assert resolve_reward_function(RewardConfig(rm_type="geo3k")) is geo3k_reward


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(rm_type="nonexistent"), "--rm-type 'nonexistent'"),
        (dict(custom_rm_path="no_colon_here"), "--custom-rm-path 'no_colon_here'"),
        (dict(custom_rm_path=":function"), "--custom-rm-path"),
        (dict(rm_tolerance=-0.1), "--rm-tolerance"),
        (dict(rm_tolerance=1.0), "--rm-tolerance"),
        (dict(rm_tolerance=float("nan")), "--rm-tolerance"),
        (dict(rm_timeout=0.0), "--rm-timeout"),
        (dict(rm_timeout=float("inf")), "--rm-timeout"),
        (dict(rm_num_workers=0), "--rm-num-workers"),
    ],
)
def test_bad_flags_raise_config_error(kwargs, flag):
    with pytest.raises(ConfigError, match=re.escape(flag)):
        RewardConfig(**kwargs)


def test_unknown_rm_type_lists_valid_names():
    with pytest.raises(ConfigError, match="deepscaler, geo3k, math"):
        RewardConfig(rm_type="mth")


# Custom reward functions for the tests below, imported by path in the workers.


def reward_length_parity(response: str, label: str, cfg: RewardConfig) -> float:
    """1.0 when the response and the label have lengths of the same parity."""
    return float(len(response) % 2 == len(label) % 2)


def reward_two_args(response: str, label: str) -> float:
    return 1.0


NOT_A_FUNCTION = 3


def chaos_reward(response: str, label: str, cfg: RewardConfig) -> float:
    """Misbehaves on command: 'hang' ignores SIGALRM and sleeps (like a long C call), 'die'
    kills its process, 'raise' raises, 'nan' returns NaN, '-inf' -inf, 'text' a string, 'huge' 10**400; else math."""
    if response == "hang":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(600)
    if response == "die":
        os._exit(3)
    if response == "raise":
        raise RuntimeError("bad reward")
    if response == "nan":
        return float("nan")
    if response == "text":
        return "1.0"  # type: ignore[return-value]
    if response == "-inf":
        return -math.inf
    if response == "huge":
        return 10**400  # an int past the float range
    return math_reward(response, label, cfg)


def _path(function) -> str:
    return f"{function.__module__}:{function.__name__}"


CHAOS = RewardConfig(custom_rm_path=_path(chaos_reward), rm_timeout=0.5)
"""The chaos reward (math for ordinary answers) with a 0.5 s soft limit, for the scorer's failure paths."""


def test_custom_reward_function_via_flag(scorers):
    cfg = RewardConfig(rm_type="math", custom_rm_path=_path(reward_length_parity))
    assert resolve_reward_function(cfg) is reward_length_parity
    # lengths: 3 vs 1 (same parity), 2 vs 1 (different), 0 vs 2 (same)
    assert scorers(cfg).score(["abc", "ab", ""], ["x", "y", "zz"]) == [1.0, 0.0, 1.0]
    # --rm-type also takes a path
    assert scorers(RewardConfig(rm_type=_path(reward_length_parity))).score(["abc"], ["x"]) == [1.0]


def test_a_custom_reward_module_not_on_the_path_hints_at_pythonpath_and_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_xyz.py").write_text("def score(response, label, cfg):\n    return 1.0\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("PYTHONPATH", "/opt/nothing-here")
    with pytest.raises(ConfigError) as info:
        RewardScorer(RewardConfig(custom_rm_path="my_rewards_xyz:score"))
    message = str(info.value)
    assert message.startswith("--custom-rm-path 'my_rewards_xyz:score' cannot be imported (No module named "
                              "'my_rewards_xyz'); Python looks for 'my_rewards_xyz' in the working directory")
    assert f"({elsewhere})" in message and "PYTHONPATH (/opt/nothing-here)" in message
    assert "add that folder to PYTHONPATH" in message
    # A function missing from a module that imports is not a path problem: no hint.
    with pytest.raises(ConfigError, match="check the module path and the function name") as info:
        RewardScorer(RewardConfig(custom_rm_path="tests.rewards:no_such_function"))
    assert "PYTHONPATH" not in str(info.value)
    # The hint holds: with the folder on sys.path (as PYTHONPATH puts it there) the same flag resolves.
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward_function(RewardConfig(custom_rm_path="my_rewards_xyz:score"))("r", "l", None) == 1.0


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_module_xyz:score", "cannot be imported"),
        (f"{__name__}:no_such_function", "cannot be imported"),
        (f"{__name__}:NOT_A_FUNCTION", "not a function"),
        (f"{__name__}:reward_two_args", r"must\s+accept \(response: str, label: str, cfg: RewardConfig\)"),
    ],
)
def test_bad_custom_reward_function_fails_at_start(path, message):
    cfg = RewardConfig(custom_rm_path=path)
    with pytest.raises(ConfigError, match=message):
        RewardScorer(cfg)


@pytest.mark.parametrize("body, raised", [("def score(response, label, cfg)\n    return 1.0\n", "SyntaxError"),
                                          ("raise RuntimeError('boom at import')\n", "RuntimeError: boom at import")])
def test_a_custom_reward_module_that_raises_while_importing_is_a_config_error_naming_the_flag(tmp_path, monkeypatch,
                                                                                             body, raised):
    """A review found a module with a syntax error (or one raising at import) gave a raw traceback and exit 1: the
    driver's set-up turns only a ConfigError into its exit-2 message naming the flag."""
    module = f"broken_rm_{raised[:6].lower()}"
    (tmp_path / f"{module}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        resolve_reward_function(RewardConfig(custom_rm_path=f"{module}:score"))
    assert str(info.value).startswith(f"--custom-rm-path '{module}:score' cannot be imported: importing it raised "
                                      f"{raised}")


# ----------------------------------------------------------------------------- scorer


def test_scorer_keeps_input_order_across_workers(scorers):
    labels = [str(n) for n in range(40)]
    responses = [rf"\boxed{{{n if n % 3 else n + 1}}}" for n in range(40)]
    expected = [0.0 if n % 3 == 0 else 1.0 for n in range(40)]
    assert scorers(MATH).score(responses, labels) == expected
    assert scorers(MATH).score([], []) == []


def test_pathological_answers_time_out_to_zero(scorers):
    scorer = scorers(CHAOS)  # math_reward for these answers, --rm-timeout 0.5
    responses = [r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{(10^{10})!}", r"\boxed{5}"]
    stats = RewardStats()
    start = time.monotonic()
    rewards = scorer.score(responses, ["5", "5", "5"], stats)
    elapsed = time.monotonic() - start
    assert rewards == [0.0, 0.0, 1.0]
    # Each is cut by the soft limit (SIGALRM in the worker) or, when a loaded machine delays the
    # alarm past the hard deadline (2 * 0.5 + 1 s), by killing its worker: both are "no result in time".
    assert (stats.responses, stats.timeouts + stats.killed, stats.errors, stats.worker_deaths) == (3, 2, 0, 0)
    # Soft limit 0.5 s, two workers in parallel; a loaded 2-core machine gets slack.
    assert elapsed < 15.0


def test_scoring_from_a_thread_keeps_the_timeout(scorers):
    # math-verify's signal-based timeout fails outside a main thread; the workers' does not care.
    scorer = scorers(CHAOS)  # math_reward for these answers, --rm-timeout 0.5
    stats = RewardStats()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
        rewards = thread.submit(scorer.score, [r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{\frac{1}{2}}"], ["5", "0.5"],
                                stats)
        assert rewards.result(timeout=60) == [0.0, 1.0]
    assert stats.timeouts == 1


def test_stuck_dead_and_failing_reward_calls_score_zero_and_are_counted(scorers, caplog):
    scorer = scorers(CHAOS)
    responses = [r"\boxed{1}", "hang", "die", "raise", "nan", "text", r"\boxed{2}"]
    stats = RewardStats()
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="slime.rollout.rm_hub.scorer"):
        rewards = scorer.score(responses, ["1", "1", "1", "1", "1", "1", "2"], stats)
    elapsed = time.monotonic() - start
    # The NaN is passed on as it is (the rollout drops its group), not made a 0.0; the str is an error.
    assert rewards[:4] + rewards[5:] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0] and math.isnan(rewards[4])
    assert (stats.responses, stats.killed, stats.worker_deaths, stats.errors, stats.timeouts) == (7, 1, 1, 2, 0)
    assert (stats.non_finite, stats.failed) == (1, 4)
    assert "4 of 7 responses scored 0.0" in caplog.text and "RuntimeError: bad reward" in caplog.text
    assert "#4" not in caplog.text  # the NaN is not a failure; its group's drop is logged
    # The hard deadline is 2 * 0.5 + 1 = 2 s, plus two worker restarts.
    assert elapsed < 60.0
    # The restarted workers score the next batch.
    assert scorer.score([r"\boxed{3}", r"\boxed{4}"], ["3", "5"]) == [1.0, 0.0]


def test_an_infinite_reward_is_passed_on_and_an_int_past_the_float_range_is_an_error(scorers, caplog):
    scorer = scorers(CHAOS)
    stats = RewardStats()
    with caplog.at_level("WARNING", logger="slime.rollout.rm_hub.scorer"):
        rewards = scorer.score(["-inf", "huge", r"\boxed{3}"], ["1", "1", "3"], stats)
    assert rewards == [-math.inf, 0.0, 1.0]  # before: 10**400 raised OverflowError out of score()
    assert (stats.non_finite, stats.errors, stats.responses) == (1, 1, 3)
    assert "1 of 3 responses scored 0.0 without a verdict (1 errors)" in caplog.text
    assert "the reward function returned a number past the float range (int)" in caplog.text


def test_empty_label_is_a_counted_error(scorers):
    scorer = scorers(MATH)
    stats = RewardStats()
    assert scorer.score([r"\boxed{5}", r"\boxed{5}"], ["", "5"], stats) == [0.0, 1.0]
    assert stats.errors == 1


def test_each_score_call_adds_to_the_stats_it_is_given_and_keeps_none(scorers):
    scorer = scorers(CHAOS)
    first, second = RewardStats(), RewardStats()
    scorer.score(["raise", r"\boxed{1}"], ["1", "1"], first)
    scorer.score(["raise"], ["1"])  # not counted anywhere
    scorer.score([r"\boxed{1}"], ["1"], first)
    scorer.score([r"\boxed{1}"], ["1"], second)
    assert (first.responses, first.errors, second.responses, second.failed) == (3, 1, 1, 0)


def test_score_rejects_mismatched_or_non_string_input(scorers):
    scorer = scorers(MATH)
    with pytest.raises(ValueError, match="2 responses but 1 labels"):
        scorer.score(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"responses\[1\] is a NoneType"):
        scorer.score(["a", None], ["1", "2"])
    with pytest.raises(TypeError, match=r"labels\[0\] is a float"):
        scorer.score(["a"], [1.5])


def test_worker_that_cannot_start_gives_a_clear_error(tmp_path):
    """A spawned worker re-imports the driver's main module; if it cannot, score() says so.

    ``python -`` (a script piped to stdin) leaves ``__main__.__file__ = '<stdin>'``, a path that
    no worker can run, so every worker dies while starting.  The same main module is set up
    here, in-process, and the exception is checked as an object (type, message, cause), not
    read back from a stderr that the dying workers write to at the same time.
    """
    unimportable_main = types.ModuleType("__main__")  # __spec__ is None, as for stdin
    unimportable_main.__file__ = str(tmp_path / "<stdin>")
    before = set(multiprocessing.active_children())
    scorer = RewardScorer(RewardConfig(rm_num_workers=2))
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "__main__", unimportable_main)
        with pytest.raises(RuntimeError) as info:
            scorer.score(["x"], ["1"])
    assert type(info.value) is RuntimeError  # not the bare BrokenProcessPool (itself a RuntimeError)
    assert str(info.value).startswith("a reward worker process exited while starting")
    assert "run the driver from a file or with -m" in str(info.value)
    assert isinstance(info.value.__cause__, BrokenProcessPool)

    # No worker is left behind, and the same scorer starts fresh ones once the main module is importable.
    deadline = time.monotonic() + 60
    while set(multiprocessing.active_children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(multiprocessing.active_children()) - before == set()
    with scorer:
        assert scorer.score([r"\boxed{1}", r"\boxed{2}"], ["1", "1"]) == [1.0, 0.0]


def test_workers_start_on_first_score_and_stop_on_close():
    before = set(multiprocessing.active_children())
    with RewardScorer(RewardConfig(rm_num_workers=1)) as own:
        assert set(multiprocessing.active_children()) == before  # nothing started yet
        assert own.score([r"\boxed{2}"], ["2"]) == [1.0]
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 1
        assert own.score([r"\boxed{2}"], ["3"]) == [0.0]
        assert set(multiprocessing.active_children()) - before == workers  # reused
    assert not any(worker.is_alive() for worker in workers)


def test_workers_see_the_environment_of_when_they_start_not_the_fork_servers(monkeypatch):
    """The fork server keeps the environment of its start; a worker takes the scorer's of when it starts."""
    from tests.rewards import environment_reward

    cfg = RewardConfig(custom_rm_path=_path(environment_reward), rm_num_workers=1)
    monkeypatch.setenv("SLIME_TEST_REWARD", "0.5")
    with RewardScorer(cfg) as first:
        assert first.score(["x"], ["1"]) == [0.5]
    monkeypatch.setenv("SLIME_TEST_REWARD", "0.25")
    with RewardScorer(cfg) as second:
        assert second.score(["x"], ["1"]) == [0.25]


def test_a_worker_exits_when_the_process_that_started_it_is_killed(tmp_path):
    """Workers fork from the fork server, so they are not the driver's children: when the driver is SIGKILLed, an
    idle worker must still leave (Ray stops an actor's direct children only)."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import os, time\n"
        "from slime.rollout.rm_hub.config import RewardConfig\n"
        "from slime.rollout.rm_hub.scorer import RewardScorer\n"
        "if __name__ == '__main__':\n"
        "    scorer = RewardScorer(RewardConfig(rm_num_workers=1))\n"
        "    scorer.score([r'\\boxed{1}'], ['1'])\n"
        "    print(scorer._workers[0]._pid.result(), flush=True)\n"
        "    time.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        worker = int(driver.stdout.readline())
        os.kill(worker, 0)  # alive while the driver is
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            if open(f"/proc/{worker}/stat").read().split(") ")[1][0] == "Z":
                break  # exited, not yet reaped by the fork server
            time.sleep(0.05)
        else:
            raise AssertionError(f"worker {worker} outlived the killed driver by 30 s")
    finally:
        driver.kill()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds are Linux-only")
def test_killing_a_worker_that_already_exited_goes_through_its_pidfd_not_its_number(monkeypatch):
    """A worker's number may go to a new process once the worker has exited and been reaped: the kill uses the pidfd
    opened while the worker was alive, which can only ever name that worker."""
    import select

    from slime.rollout.rm_hub.scorer import _Worker, worker_context

    worker = _Worker(worker_context(), MATH)
    worker.wait_started()
    pid, pidfd = worker._pid.result(), worker._pidfd
    assert pidfd is not None
    os.kill(pid, signal.SIGKILL)  # it dies on its own account
    assert select.select([pidfd], [], [], 30)[0] == [pidfd]  # a pidfd turns readable when its process exits
    monkeypatch.setattr(os, "kill", lambda *args: pytest.fail(f"os.kill{args}: a signal by number"))
    worker.kill()  # ESRCH through the pidfd, swallowed
    assert worker._pidfd is None  # closed


def test_closed_scorer_refuses_to_score():
    with RewardScorer(MATH) as closed:  # no worker starts before the first score()
        pass
    with pytest.raises(RuntimeError, match="after close"):
        closed.score(["x"], ["1"])


# ----------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slime.rollout.rm_hub", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_cli_prints_one_reward_per_response():
    responses = [r"\boxed{13.86}", "no box", r"<think></think>\boxed{8\sqrt{3}}", r"\boxed{14}"]
    common = ["--rm-type", "geo3k", "--rm-num-workers", "1", "--label", r"8\sqrt{3}"]
    geo3k = _cli(*common, *responses)
    assert geo3k.returncode == 0, geo3k.stderr
    assert geo3k.stdout.splitlines() == ["1.0", "0.0", "1.0", "0.0"]
    strict = _cli(*common, "--rm-tolerance", "0", *responses)
    assert strict.returncode == 0, strict.stderr
    assert strict.stdout.splitlines() == ["0.0", "0.0", "1.0", "0.0"]


def test_cli_help_and_bad_flag():
    help_run = _cli("--help")
    assert help_run.returncode == 0 and "--rm-tolerance" in help_run.stdout and "--label" in help_run.stdout
    bad = _cli("--rm-type", "nope", "--label", "1", "x")
    assert bad.returncode == 2 and "--rm-type 'nope' is not a reward function" in bad.stderr
