#!/usr/bin/env python
"""Size figures of a Python package: lines per file, docstring lines against code lines, long module docstrings.

  python scripts/tools/code_stats.py [PACKAGE_DIR] [--max-file-lines 600] [--max-module-doc 25] [--max-doc-ratio 0.4]

Counts, per ``.py`` file: ``lines`` (all), ``doc`` (lines inside docstrings: module, class and function docstrings,
found with ``ast``), ``code`` (non-blank lines that are neither docstring nor comment-only).  Prints the totals, the
ratio doc / code, the files over ``--max-file-lines``, the module docstrings over ``--max-module-doc`` lines and the
functions whose docstring has more lines than their body; exits 1 when a limit is broken.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path


@dataclasses.dataclass
class FileStats:
    path: Path
    lines: int
    doc: int
    code: int
    module_doc: int
    long_docs: list[str]


def docstring_lines(node: ast.AST) -> set[int]:
    """1-based line numbers of ``node``'s docstring (empty if it has none)."""
    body = getattr(node, "body", None)
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant):
        return set()
    if not isinstance(body[0].value.value, str):
        return set()
    return set(range(body[0].lineno, body[0].end_lineno + 1))


def file_stats(path: Path) -> FileStats:
    """The counts of the module docstring for one file.

    Raises:
        SyntaxError: the file does not parse.
    """
    text = path.read_text()
    tree = ast.parse(text)
    source = text.splitlines()
    doc = docstring_lines(tree)
    module_doc = len(doc)
    long_docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines = docstring_lines(node)
            doc |= lines
            if lines and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:]
                body_lines = sum(b.end_lineno - b.lineno + 1 for b in body)
                if len(lines) > body_lines:
                    long_docs.append(f"{path}:{node.lineno} {node.name} (doc {len(lines)} > body {body_lines})")
    code = sum(1 for i, line in enumerate(source, 1)
               if i not in doc and line.strip() and not line.strip().startswith("#"))
    return FileStats(path, len(source), len(doc), code, module_doc, long_docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", type=Path, default=Path(__file__).resolve().parents[2] / "slime")
    parser.add_argument("--max-file-lines", type=int, default=600)
    parser.add_argument("--max-module-doc", type=int, default=25)
    parser.add_argument("--max-doc-ratio", type=float, default=0.4)
    parser.add_argument("--show-long-docstrings", action="store_true",
                        help="list the functions whose docstring is longer than their body")
    args = parser.parse_args(argv)
    stats = [file_stats(p) for p in sorted(args.package.rglob("*.py"))]
    doc, code, lines = (sum(getattr(s, f) for s in stats) for f in ("doc", "code", "lines"))
    ratio = doc / max(code, 1)
    big = [s for s in stats if s.lines > args.max_file_lines]
    long_module = [s for s in stats if s.module_doc > args.max_module_doc]
    long_docs = [d for s in stats for d in s.long_docs]
    print(f"{len(stats)} files, {lines} lines: {code} code, {doc} docstring; docstring / code = {ratio:.3f} "
          f"(limit {args.max_doc_ratio})")
    print(f"files over {args.max_file_lines} lines: {len(big)}" + "".join(f"\n  {s.path} {s.lines}" for s in big))
    print(f"module docstrings over {args.max_module_doc} lines: {len(long_module)}"
          + "".join(f"\n  {s.path} {s.module_doc}" for s in long_module))
    print(f"functions whose docstring is longer than their body: {len(long_docs)}")
    if args.show_long_docstrings:
        print("".join(f"  {d}\n" for d in long_docs), end="")
    return 1 if big or long_module or ratio > args.max_doc_ratio else 0


if __name__ == "__main__":
    sys.exit(main())
