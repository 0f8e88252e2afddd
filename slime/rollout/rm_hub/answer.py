"""Final-answer extraction and parsing shared by every reward function.

A response states its final answer as ``\\boxed{...}`` (or ``\\fbox{...}``), the format the
geo3k recipe asks for (the SFT data of upstream slime's ``examples/geo3k_vlm/README.md`` is
``Answer: \\boxed{<answer>}``).  This module finds that answer and turns answer strings into
SymPy objects with ``math-verify`` (pinned 0.9.0):

- :func:`last_boxed` returns the content of the last box, braces balanced;
- :func:`parse_latex` parses an answer (a gold label or a boxed content) as LaTeX math;
- :func:`numeric_value` evaluates a parsed answer to a float, for the tolerance of the
  ``geo3k`` reward.

None of these functions has a timeout: SymPy can run for ever on an answer such as
``9^{9^{9^{9^{9}}}}``.  The scorer (:mod:`slime.rollout.rm_hub.scorer`) calls them in
worker processes under a ``SIGALRM`` timer and a hard deadline.
"""

from __future__ import annotations

import math
import re

import sympy
from math_verify import parse

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
"""``\\boxed{`` or ``\\fbox{``, optionally with spaces before the brace (``\\boxed {5}``)."""
_TEXT_OPEN = re.compile(r"\\(?:text|textrm|textnormal|textbf|textit|mbox)\s*\{")
"""The text-mode groups :func:`unwrap_math_text` may unwrap (``\\text{``, ``\\textrm{``, ``\\mbox{``, ...)."""


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    Braces are matched, so nested groups come back whole:
    ``"so \\boxed{\\frac{1}{2}}."`` gives ``"\\frac{1}{2}"``.  Escaped braces (``\\{``,
    ``\\}``) do not count.  Only the last box is read (a response that changes its mind
    is graded on its final answer), and a last box that is never closed (a response cut
    at the length limit) gives ``None``, not an earlier box: this is how upstream slime's
    ``last_boxed_only_string`` treats both cases.  ``\\boxed 5`` (no braces) is not
    recognised.

    Args:
        text: a model response (any string).

    Returns:
        The content between the braces, not stripped, or ``None`` when there is no
        complete last box.
    """
    openings = list(_BOX_OPEN.finditer(text))
    if not openings:
        return None
    end = _closing_brace(text, openings[-1].end())
    return None if end is None else text[openings[-1].end() : end]


def _closing_brace(text: str, start: int) -> int | None:
    """The index of the ``}`` that closes the group whose content starts at ``start`` (just after
    its ``{``), skipping escaped characters (``\\{``, ``\\}``); None if the group never closes."""
    depth = 1
    position = start
    while position < len(text):
        char = text[position]
        if char == "\\":
            position += 2  # an escaped character, e.g. \{ or \}, is not a brace
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return position
        position += 1
    return None


def unwrap_math_text(answer: str) -> str:
    """Replace every ``\\text{...}`` (or ``\\textrm``, ``\\textnormal``, ``\\mbox``) whose content
    is one math expression by that content, so that math-verify grades it as math.

    math-verify reads ``\\text{12.6}`` as the *symbol* named ``12.6``, not the number, and
    ``\\text{4\\sqrt{3}}`` as text, so a model that wraps its answer in ``\\text{}`` scored 0
    against ``12.6`` / ``4\\sqrt{3}`` (integers happen to pass).  A content counts as one math
    expression when math-verify parses ``$content$`` to a SymPy expression without free
    symbols (an assignment ``x = 5`` by its right side), math-verify's own unit stripping
    applied (``12.6 cm`` is 12.6).  Anything else stays wrapped: words (``\\text{ or }``,
    ``\\text{cm}``), letters (``\\text{C}``), and several values (``\\text{71 or 33}``
    parses to the set {33, 71}).  So the hedge ``71 \\text{ or } 33`` is left as it is (and
    scores 0 against 71), while ``\\text{12.6 cm}`` becomes ``12.6 cm``.

    Args:
        answer: bare LaTeX (a boxed content or a label).

    Returns:
        ``answer`` with the qualifying groups unwrapped (stripped of surrounding spaces);
        unchanged when it has none.  Groups that never close are left alone.
    """
    pieces, position = [], 0
    for opening in _TEXT_OPEN.finditer(answer):
        if opening.start() < position:  # inside a group already handled
            continue
        end = _closing_brace(answer, opening.end())
        if end is None:
            break
        content = answer[opening.end() : end]
        pieces.append(answer[position : opening.start()])
        pieces.append(content.strip() if _is_one_expression(content) else answer[opening.start() : end + 1])
        position = end + 1
    return "".join(pieces) + answer[position:] if pieces else answer


def _is_one_expression(content: str) -> bool:
    """Whether math-verify parses ``$content$`` to one SymPy expression without free symbols."""
    if not content.strip():
        return False
    expr = parsed_expression(parse(f"${content}$", parsing_timeout=None))
    return isinstance(expr, sympy.Expr) and not expr.free_symbols


def parse_latex(answer: str) -> list:
    """Parse one answer string as LaTeX math with math-verify, after wrapping it in ``$...$``.

    The wrapping matters: math-verify's ``parse`` looks for a math environment and, when
    there is none, falls back to a plain-expression regex that reads only the leading
    number, so ``parse("8\\sqrt{3}")`` is ``[8, "8"]`` while ``parse("$8\\sqrt{3}$")`` is
    ``[8*sqrt(3), "8\\sqrt{3}"]``.  Gold labels (``5\\sqrt{3}``, ``\\frac{5}{3}\\pi``) and
    boxed contents are both bare LaTeX, so both are parsed the same way here.

    math-verify's own normalisation handles ``\\dfrac``/``\\tfrac``, ``\\sqrt3``,
    degrees (``^\\circ``, ``^{\\circ}``, ``°``), ``\\text{...}`` units, thousands
    separators (``1,200``) and assignments (``x = 5`` parses as ``Eq(x, 5)``, which
    ``verify`` compares by its right side).

    Its parsing timeout is disabled (``parsing_timeout=None``): it relies on
    ``signal.alarm`` with whole seconds and swallows the timeout, so the scorer applies
    one timer around the whole reward call instead (see :mod:`.scorer`).

    ``\\text{...}`` groups that hold one math expression are unwrapped first
    (:func:`unwrap_math_text`: ``\\text{12.6 cm}`` -> ``12.6 cm``), since math-verify would
    read them as symbols or words.

    Args:
        answer: bare LaTeX, e.g. ``"\\frac{40}{3}"``.

    Returns:
        math-verify's parse result: usually ``[sympy_expr, normalised_string]``; ``[]``
        when nothing could be extracted (an empty or blank answer).
    """
    return parse(f"${unwrap_math_text(answer)}$", parsing_timeout=None)


def parsed_expression(parsed: list) -> sympy.Basic | None:
    """The first SymPy object of a :func:`parse_latex` result (math-verify puts the expression
    before its string form), with an assignment ``x = 5`` taken as its right side; None if there is none."""
    expr = next((item for item in parsed if isinstance(item, sympy.Basic)), None)
    return expr.rhs if isinstance(expr, sympy.Eq) else expr


def numeric_value(parsed: list) -> float | None:
    """The real number a parsed answer stands for, or ``None`` when it is not one number.

    Takes the first SymPy object of ``parsed`` (math-verify puts the expression before
    its string form); an assignment ``x = 5`` counts as its right side.  The expression
    must have no free symbols and evaluate (``evalf`` to 30 significant digits) to a
    finite real number.

    Args:
        parsed: the output of :func:`parse_latex`.

    Returns:
        A float (e.g. ``13.856406460551018`` for ``8\\sqrt{3}``), or ``None`` for sets,
        intervals, symbols, complex or non-finite values, and strings that did not parse.
    """
    expr = parsed_expression(parsed)
    if not isinstance(expr, sympy.Expr) or expr.free_symbols:
        return None
    value = expr.evalf(30)
    if not value.is_real:
        return None
    number = float(value)
    return number if math.isfinite(number) else None
