"""Final-answer extraction and parsing shared by every reward function (``math-verify``, pinned 0.9.0).

:func:`last_boxed` finds the answer (``\\boxed{...}`` or ``\\fbox{...}``, the geo3k recipe's format),
:func:`answer_alternatives` splits a hedge into its values, :func:`parse_latex` parses an answer as
LaTeX math, :func:`numeric_value` evaluates it.  None has a timeout: the scorer runs them in worker
processes under a timer (``docs/design/rewards.md``).
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
_WORD_SEPARATOR = re.compile(r"(?<![A-Za-z\\])(?:or|and)(?![A-Za-z])")
"""The words ``or`` and ``and`` (not inside a longer word or a command) that separate alternatives."""
_TEXT_SEPARATOR = re.compile(r"(?<![A-Za-z])(?:or|and)(?![A-Za-z])|,(?:(?<!\d,)|(?!\d{3}(?!\d)))")
"""Inside a text group: ``or``, ``and``, or a comma that is not a thousands separator (``1,200``)."""
_OPENERS, _CLOSERS = "([{", ")]}"


def last_boxed(text: str) -> str | None:
    """The content (not stripped) of the last ``\\boxed{...}`` or ``\\fbox{...}`` of ``text``, braces matched.

    ``None`` when the last box never closes (a response cut at the length limit), as upstream slime's
    ``last_boxed_only_string``; escaped braces do not count.
    """
    openings = list(_BOX_OPEN.finditer(text))
    if not openings:
        return None
    end = _closing_brace(text, openings[-1].end())
    return None if end is None else text[openings[-1].end() : end]


def _closing_brace(text: str, start: int) -> int | None:
    """Index of the ``}`` closing the group whose content starts at ``start``, escapes skipped; None if unclosed."""
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


def answer_alternatives(answer: str) -> list[str] | None:
    """The alternatives (stripped, at least two) of an answer that offers several values, or None.

    Split at ``or`` / ``and`` (bare, or inside a ``\\text{...}`` group, whose wrapping each side keeps) and
    at commas, outside brackets and not as a thousands separator: ``(3, 4)``, ``\\{1, 2\\}``, ``1,200`` stay whole.
    """
    pieces: list[list[str]] = [[]]
    depth, position = 0, 0
    while position < len(answer):
        opening = _TEXT_OPEN.match(answer, position)
        if opening and depth == 0:
            end = _closing_brace(answer, opening.end())
            if end is None:
                pieces[-1].append(answer[position:])
                break
            for k, part in enumerate(_TEXT_SEPARATOR.split(answer[opening.end() : end])):
                if k:
                    pieces.append([])
                if part.strip():
                    pieces[-1].append(f"{opening.group()}{part}}}")
            position = end + 1
            continue
        char = answer[position]
        if char == "\\":
            pair = answer[position : position + 2]  # a command's backslash, or an escaped \{ \} \,
            depth += (pair == "\\{") - (pair == "\\}")
            pieces[-1].append(pair)
            position += 2
            continue
        depth += (char in _OPENERS) - (char in _CLOSERS)
        if depth == 0 and char == "," and not _thousands_separator(answer, position):
            pieces.append([])
            position += 1
            continue
        word = _WORD_SEPARATOR.match(answer, position) if depth == 0 else None
        if word:
            pieces.append([])
            position = word.end()
            continue
        pieces[-1].append(char)
        position += 1
    alternatives = [text for text in ("".join(piece).strip() for piece in pieces) if text]
    return alternatives if len(alternatives) >= 2 else None


def _thousands_separator(text: str, comma: int) -> bool:
    before = text[comma - 1] if comma else ""
    after = text[comma + 1 : comma + 5]
    return before.isdigit() and len(after) >= 3 and after[:3].isdigit() and not after[3:4].isdigit()


def unwrap_math_text(answer: str) -> str:
    """``answer`` with each ``\\text{...}`` (or ``\\textrm``, ``\\mbox``, ...) holding one math expression unwrapped.

    One expression: math-verify parses ``$content$`` to an expression without free symbols (units
    stripped), so ``\\text{12.6 cm}`` -> ``12.6 cm``; words, letters and several values stay wrapped, as do
    groups that never close.
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
    if not content.strip():
        return False
    expr = parsed_expression(parse(f"${content}$", parsing_timeout=None))
    return isinstance(expr, sympy.Expr) and not expr.free_symbols


def parse_latex(answer: str) -> list:
    """math-verify's parse of ``$answer$`` (after :func:`unwrap_math_text`): ``[sympy_expr, string]``, ``[]`` if empty.

    Wrapped in ``$...$`` because without a math environment math-verify reads only the leading number;
    its parsing timeout is disabled (the scorer times the whole call).
    """
    return parse(f"${unwrap_math_text(answer)}$", parsing_timeout=None)


def parsed_expression(parsed: list) -> sympy.Basic | None:
    """The first SymPy object of a :func:`parse_latex` result, an assignment ``x = 5`` as its right side; or None."""
    expr = next((item for item in parsed if isinstance(item, sympy.Basic)), None)
    return expr.rhs if isinstance(expr, sympy.Eq) else expr


def numeric_value(parsed: list) -> float | None:
    """The finite real number (``evalf`` to 30 digits) a parsed answer stands for, or ``None``.

    ``None`` for sets, intervals, symbols, complex or non-finite values and text that did not parse.
    """
    expr = parsed_expression(parsed)
    if not isinstance(expr, sympy.Expr) or expr.free_symbols:
        return None
    value = expr.evalf(30)
    if not value.is_real:
        return None
    number = float(value)
    return number if math.isfinite(number) else None
