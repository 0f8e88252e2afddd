"""The process's fork-server preload (:mod:`slime.utils.forkserver`): callers add to it, none replaces another's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=120).stdout


def test_a_second_caller_adds_to_the_first_ones_preload_and_the_default_main_is_dropped():
    out = _run("from slime.utils.forkserver import forkserver_context, preloaded\n"
               "print(preloaded())\n"  # the standard library's default, ['__main__'], is not reported
               "forkserver_context(['json', 'csv'])\n"
               "forkserver_context(['csv', 'fractions'])\n"
               "print(preloaded())")
    assert out.splitlines() == ["[]", "['json', 'csv', 'fractions']"]


def test_a_worker_forked_from_the_server_has_the_preloaded_modules_before_it_imports_anything(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import sys\n"
                      "from slime.utils.forkserver import forkserver_context\n"
                      "def has(name):\n"
                      "    return name in sys.modules\n"
                      "if __name__ == '__main__':\n"
                      "    ctx = forkserver_context(['fractions'])\n"
                      "    with ctx.Pool(1) as pool:\n"
                      "        print(pool.apply(has, ('fractions',)), pool.apply(has, ('decimal',)),\n"
                      "              pool.apply(has, ('wave',)))\n")
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True, timeout=120).stdout
    # fractions imports decimal: both are in the worker, though neither the worker nor pickling asked for them; a
    # module nobody imported is not
    assert out.split() == ["True", "True", "False"]
