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


def test_a_tmpdir_too_deep_for_the_socket_is_named_and_one_that_fits_starts(tmp_path):
    """The server's socket sits under TMPDIR (this Python's ``arbitrary_address``: ``pymp-X/listener-X`` up to 3.13,
    ``pymp-X/sock-X`` later).  With the socket path at 107 bytes a pool starts; at 108 the standard library's own
    start fails with a bare OSError, and ours names the directory first."""
    suffix = int(_run("import multiprocessing.connection as c, tempfile\n"
                      "print(len(c.arbitrary_address('AF_UNIX')) - len(tempfile.gettempdir()))"))

    def tmpdir_for(socket_bytes: int) -> str:
        path = str(tmp_path) + "/" + "d" * (socket_bytes - suffix - len(str(tmp_path)) - 1)
        os.makedirs(path, exist_ok=True)
        return path

    start = ("import multiprocessing\n"
             "from slime.utils.forkserver import forkserver_context\n"
             "if __name__ == '__main__':\n"
             "    with {ctx}.Pool(1) as pool:\n"
             "        print(pool.apply(abs, (-3,)))\n")
    script = tmp_path / "start.py"

    def run(socket_bytes: int, ctx: str):
        script.write_text(start.format(ctx=ctx))
        env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": tmpdir_for(socket_bytes)}
        return subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)

    fits = run(107, "forkserver_context()")
    assert fits.returncode == 0 and fits.stdout.split() == ["3"], fits.stderr[-2000:]
    bare = run(108, "multiprocessing.get_context('forkserver')")
    assert bare.returncode != 0 and "AF_UNIX path too long" in bare.stderr
    ours = run(108, "forkserver_context()")
    assert ours.returncode != 0 and "ForkServerUnavailable" in ours.stderr and "(108 bytes)" in ours.stderr
    assert f"the temporary directory {tmpdir_for(108)} (TMPDIR) is too deep" in ours.stderr
