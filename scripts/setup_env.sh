#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv and install slime with its pinned dependencies.
#
# Sourced by examples/geo3k_vlm/run_geo3k_qwen35.sh and scripts/run_tests.sh, so a fresh
# machine needs nothing else.  Idempotent: a second call installs nothing.
#
#   SLIME_VENV        virtualenv folder (default: <repo>/.venv). Set SLIME_VENV=none to use
#                     the current python as it is (e.g. inside a prepared GPU image).
#   SLIME_PYTHON      interpreter that creates the venv (default: python3, must be >= 3.11).
#   SLIME_EXTRAS      pip extras to install, comma-separated (default: test).
#   SLIME_SKIP_SETUP  1: install nothing; use the current python as it is (an offline, prepared
#                     image: put the repo on PYTHONPATH yourself).
set -euo pipefail

if [ "${SLIME_SKIP_SETUP:-0}" = "1" ]; then
  return 0 2>/dev/null || exit 0
fi

SLIME_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
SLIME_VENV="${SLIME_VENV:-$SLIME_ROOT/.venv}"
SLIME_PYTHON="${SLIME_PYTHON:-python3}"
SLIME_EXTRAS="${SLIME_EXTRAS:-test}"

if [ "$SLIME_VENV" != "none" ]; then
  if [ ! -x "$SLIME_VENV/bin/python" ]; then
    echo "[setup] creating virtualenv $SLIME_VENV"
    "$SLIME_PYTHON" -m venv "$SLIME_VENV"
  fi
  # shellcheck disable=SC1091
  source "$SLIME_VENV/bin/activate"
fi

stamp="$(python -c 'import sys; print(sys.prefix)')/.slime-setup-stamp"
want="$(cat "$SLIME_ROOT/pyproject.toml" "$SLIME_ROOT/requirements/constraints.txt" | cksum | cut -d' ' -f1)-$SLIME_EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c 'import slime' 2>/dev/null; then
  return 0 2>/dev/null || exit 0
fi

python -c 'import sys; assert sys.version_info >= (3, 11), f"slime needs Python >= 3.11, got {sys.version}"'
echo "[setup] installing slime[$SLIME_EXTRAS] with pinned dependencies (log: $SLIME_ROOT/.setup.log)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, alone: on the CPU machines torch==2.13.0 is a CPU build on local disk. Installing it
# before anything else means no later requirement can pull a multi-GB CUDA build.
if ! python -c 'import torch' 2>/dev/null; then
  python -m pip install "torch==$(grep -E '^torch==' "$SLIME_ROOT/requirements/constraints.txt" | cut -d= -f3)" >"$SLIME_ROOT/.setup.log" 2>&1 \
    || { echo "[setup] torch install failed; see $SLIME_ROOT/.setup.log" >&2; tail -20 "$SLIME_ROOT/.setup.log" >&2; exit 1; }
fi
python -m pip install -c "$SLIME_ROOT/requirements/constraints.txt" -e "$SLIME_ROOT[$SLIME_EXTRAS]" >>"$SLIME_ROOT/.setup.log" 2>&1 \
  || { echo "[setup] pip install failed; see $SLIME_ROOT/.setup.log" >&2; tail -20 "$SLIME_ROOT/.setup.log" >&2; exit 1; }
echo "$want" >"$stamp"
echo "[setup] done: $(python -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
