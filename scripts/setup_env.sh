#!/usr/bin/env bash
# Create (or reuse) the project's environment and install slime with one pinned profile.
#
# Sourced by examples/geo3k_vlm/run_geo3k_qwen35.sh and scripts/run_tests.sh, so a fresh
# machine needs nothing else. Idempotent: a second call installs nothing.
#
# Profiles (exact pins; pyproject.toml has the ranges that admit both):
#   cpu  requirements/cpu.txt: torch 2.13.0 (CPU build), transformers 5.17.0, Python >= 3.11.
#        Chosen where nvidia-smi lists no GPU. torch is installed first, alone, and only as a CPU
#        build: the one pip's find-links hold on local disk when they hold one (asked with
#        --no-index: CI and the project's machines), else the one of SLIME_TORCH_INDEX_URL. pip's
#        index is not asked which build it serves: PyPI's Linux torch is a CUDA build of several GB,
#        and finding that out can cost downloading it. Set-up stops rather than install a CUDA torch.
#   gpu  requirements/gpu.txt: torch 2.11.0, transformers 5.12.1, megatron-core 0.16.1, fla 0.6.0
#        with tilelang, SGLang 0.5.17 and its kernels, CPython 3.12. Chosen where `nvidia-smi -L`
#        lists a GPU. An installed torch whose version (without its +cuXXX label) equals the pin
#        is kept, with its CUDA libraries; then pip installs only what is missing or differs.
#
#   SLIME_PROFILE     cpu | gpu: force a profile (default: by nvidia-smi, as above).
#   SLIME_VENV        virtualenv folder (default: <repo>/.venv; with the gpu profile it is created
#                     on top of SLIME_PYTHON's packages when that python has torch, so an image's
#                     torch is kept). none: install into the current python (a GPU image).
#   SLIME_PYTHON      interpreter that creates the venv (default: python3).
#   SLIME_EXTRAS      slime extras, comma-separated (default: cpu test; gpu test,megatron,sglang;
#                     with SLIME_WHEELHOUSE, the extras the wheelhouse was built for).
#   SLIME_WHEELHOUSE  folder made by scripts/offline_bundle.sh (every part's files gathered in
#                     it), or any folder of wheels: install from it with no network
#                     (pip --no-index --find-links), or unpack its packed tree onto PYTHONPATH.
#   SLIME_SITE_DIR    where a packed wheelhouse is unpacked (default: <repo>/.cache/site).
#   SLIME_TORCH_INDEX_URL  cpu profile: an index with torch's CPU build, used only when pip's
#                     find-links hold no CPU build of the pin (default: PyTorch's,
#                     https://download.pytorch.org/whl/cpu; a mirror of it where that is not reachable).
#   SLIME_SKIP_SETUP  1: install nothing; use the current python as it is (an offline, prepared
#                     image: put the repo on PYTHONPATH yourself). 0 or empty: set up; else refused.
#
# Run it directly to see the plan without installing anything:  bash scripts/setup_env.sh --dry-run
set -euo pipefail

case "${SLIME_SKIP_SETUP:-}" in  # a switch: 0, 1 or empty/unset (0); true, yes... are refused
  ""|0) ;;
  1) return 0 2>/dev/null || exit 0 ;;
  *) echo "[setup] SLIME_SKIP_SETUP=$SLIME_SKIP_SETUP: expected 0 or 1 (or empty/unset, meaning 0)" >&2; exit 2 ;;
esac

SLIME_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
_slime_dry_run=0
if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # executed, not sourced: arguments are ours
  case "${1:-}" in
    "") ;;
    --dry-run) _slime_dry_run=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "[setup] unknown argument $1 (use --dry-run or --help)" >&2; exit 2 ;;
  esac
fi
_slime_fail() { echo "[setup] $*" >&2; exit 1; }
_slime_tool() { "$_slime_py" "$SLIME_ROOT/scripts/tools/profile_lock.py" "$@"; }

# --- which profile ------------------------------------------------------------------------------
case "${SLIME_PROFILE:-}" in
  cpu|gpu) _slime_profile=$SLIME_PROFILE; _slime_why="SLIME_PROFILE=$SLIME_PROFILE" ;;
  "")
    if _slime_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU [0-9]') && [ "$_slime_gpus" -gt 0 ]; then
      _slime_profile=gpu; _slime_why="nvidia-smi lists $_slime_gpus GPU(s)"
    else
      _slime_profile=cpu; _slime_why="nvidia-smi lists no GPU"
    fi ;;
  *) _slime_fail "SLIME_PROFILE=$SLIME_PROFILE: use cpu or gpu, or leave it unset to choose by nvidia-smi" ;;
esac
_slime_lock="$SLIME_ROOT/requirements/$_slime_profile.txt"
[ "$_slime_dry_run" = 0 ] || echo "[setup] profile: $_slime_profile ($_slime_why); pins: ${_slime_lock#"$SLIME_ROOT"/}"
SLIME_VENV="${SLIME_VENV:-$SLIME_ROOT/.venv}"
SLIME_PYTHON="${SLIME_PYTHON:-python3}"

# --- which python -------------------------------------------------------------------------------
_slime_py=python
if [ "$SLIME_VENV" != "none" ]; then
  if [ ! -x "$SLIME_VENV/bin/python" ]; then
    _slime_venv_args=()
    if [ "$_slime_profile" = gpu ] && "$SLIME_PYTHON" -c 'import importlib.metadata as m; m.version("torch")' 2>/dev/null; then
      _slime_venv_args=(--system-site-packages)  # keep the image's torch and CUDA libraries
    fi
    if [ "$_slime_dry_run" = 1 ]; then
      echo "[setup] would create virtualenv $SLIME_VENV with $SLIME_PYTHON ${_slime_venv_args[*]:-}"
      _slime_py=$SLIME_PYTHON
    else
      echo "[setup] creating virtualenv $SLIME_VENV${_slime_venv_args[*]:+ on top of the packages of $SLIME_PYTHON (its torch is kept)}"
      "$SLIME_PYTHON" -m venv "${_slime_venv_args[@]}" "$SLIME_VENV"
    fi
  fi
  if [ -x "$SLIME_VENV/bin/python" ]; then
    # shellcheck disable=SC1091
    source "$SLIME_VENV/bin/activate"
  fi
fi
"$_slime_py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || _slime_fail "slime needs Python >= 3.11, $(command -v "$_slime_py") is $("$_slime_py" -V 2>&1)"
_slime_pyver=$("$_slime_py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
_slime_lock_py=$(sed -n 's/^#! python //p' "$_slime_lock")
if [ -n "$_slime_lock_py" ] && [ "$_slime_lock_py" != "$_slime_pyver" ]; then
  _slime_fail "the $_slime_profile profile ($_slime_lock) is locked for CPython $_slime_lock_py; $(command -v "$_slime_py") is $_slime_pyver. Use SLIME_PYTHON=python$_slime_lock_py (with a new SLIME_VENV), or SLIME_PROFILE=cpu"
fi

# --- where packages come from -------------------------------------------------------------------
_slime_pip_src=()
SLIME_WH_FORM="" SLIME_WH_EXTRAS="" SLIME_WH_SECTIONS="" SLIME_WH_LINKS="" SLIME_WH_SITE=""
if [ -n "${SLIME_WHEELHOUSE:-}" ]; then
  _slime_wh_vars=$("$_slime_py" "$SLIME_ROOT/scripts/tools/offline_bundle.py" prepare "$SLIME_WHEELHOUSE" \
                   --site-dir "${SLIME_SITE_DIR:-$SLIME_ROOT/.cache/site}") || exit 1
  eval "$_slime_wh_vars"
  _slime_pip_src=(--no-index --find-links "$SLIME_WH_LINKS")
fi

# --- which extras -------------------------------------------------------------------------------
if [ -n "${SLIME_EXTRAS:-}" ]; then
  _slime_extras=$SLIME_EXTRAS
elif [ -n "$SLIME_WH_EXTRAS" ]; then
  _slime_extras=$SLIME_WH_EXTRAS
elif [ "$_slime_profile" = gpu ]; then
  _slime_extras=test,megatron,sglang
else
  _slime_extras=test
fi
_slime_sections=$(_slime_tool sections "$_slime_lock" --extras "$_slime_extras")
_slime_nodeps=$(_slime_tool sections "$_slime_lock" --extras "$_slime_extras" --no-deps)
if [ -n "$SLIME_WH_SECTIONS" ]; then
  for _s in $_slime_sections; do
    if [[ ",$SLIME_WH_SECTIONS,build,torch," != *",$_s,"* ]]; then
      _slime_fail "SLIME_EXTRAS=$_slime_extras needs the $_s section of $_slime_lock, which $SLIME_WHEELHOUSE leaves out (built for --extras $SLIME_WH_EXTRAS): rebuild it with scripts/offline_bundle.sh --extras $_slime_extras"
    fi
  done
fi
_slime_pip_extras=$(echo ",$_slime_extras," | sed -E "$(for _s in $_slime_nodeps; do printf 's/,%s,/,/g;' "$_s"; done)s/^,//; s/,$//")

# --- torch: keep the installed one when the profile's pin admits it ------------------------------
_slime_torch_pin=$(_slime_tool pin "$_slime_lock" torch)
_slime_torch_have=$("$_slime_py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ -n "$_slime_torch_have" ] && [ "${_slime_torch_have%%+*}" = "$_slime_torch_pin" ]; then
  _slime_torch_plan="keep torch $_slime_torch_have (the $_slime_profile profile pins $_slime_torch_pin)"
  _slime_torch_install=0
else
  _slime_torch_plan="install torch==$_slime_torch_pin${_slime_torch_have:+ (replacing torch $_slime_torch_have)}"
  _slime_torch_install=1
fi

# cpu profile: which CPU build of torch, from where (pip is asked without installing anything).
# The exact version found (2.13.0+cpu) is installed, so no other build of the pin can win.
_slime_torch_src=() _slime_torch_req="torch==$_slime_torch_pin"
if [ "$_slime_torch_install" = 1 ] && [ "$_slime_profile" = cpu ] && [ -z "${SLIME_WHEELHOUSE:-}" ]; then
  SLIME_TORCH_INDEX_URL="${SLIME_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  if _slime_probe=$(_slime_tool torch-build "torch==$_slime_torch_pin" --local-only); then
    _slime_torch_plan+=" from pip's find-links: $_slime_probe"
  else
    _slime_probe_local=$_slime_probe
    if _slime_probe=$(_slime_tool torch-build "torch==$_slime_torch_pin" -- --index-url "$SLIME_TORCH_INDEX_URL"); then
      _slime_torch_src=(--extra-index-url "$SLIME_TORCH_INDEX_URL")  # pip's own index still serves torch's dependencies
      _slime_torch_plan+=" from SLIME_TORCH_INDEX_URL=$SLIME_TORCH_INDEX_URL: $_slime_probe (pip's find-links: $_slime_probe_local)"
    else
      _slime_fail "the cpu profile needs a CPU build of torch==$_slime_torch_pin, and none was found: pip's find-links (asked with --no-index): $_slime_probe_local; SLIME_TORCH_INDEX_URL=$SLIME_TORCH_INDEX_URL: $_slime_probe. Point SLIME_TORCH_INDEX_URL at an index with torch's CPU build (PyTorch's is https://download.pytorch.org/whl/cpu), or use SLIME_WHEELHOUSE"
    fi
  fi
  _slime_torch_req="torch==$(echo "$_slime_probe" | cut -d' ' -f2)"
fi

_slime_stamp="$("$_slime_py" -c 'import sys; print(sys.prefix)')/.slime-setup-stamp"
_slime_want_base="$_slime_profile-$(cat "$SLIME_ROOT/pyproject.toml" "$_slime_lock" | cksum | cut -d' ' -f1)-$_slime_extras-${SLIME_WH_FORM:-index}-torch"
_slime_want="$_slime_want_base${_slime_torch_have:-none}"

if [ "$_slime_dry_run" = 1 ]; then
  echo "[setup] python: $(command -v "$_slime_py") ($_slime_pyver)"
  echo "[setup] extras: $_slime_extras (sections: $_slime_sections${_slime_nodeps:+; installed with --no-deps: $_slime_nodeps})"
  if [ -n "${SLIME_WHEELHOUSE:-}" ]; then
    echo "[setup] packages from: wheelhouse $SLIME_WHEELHOUSE ($SLIME_WH_FORM${SLIME_WH_LINKS:+: $SLIME_WH_LINKS}${SLIME_WH_SITE:+: $SLIME_WH_SITE}), no index"
  else
    echo "[setup] packages from: the package index"
  fi
  echo "[setup] torch: $_slime_torch_plan"
  if [ -f "$_slime_stamp" ] && [ "$(cat "$_slime_stamp")" = "$_slime_want" ]; then
    echo "[setup] state: up to date (nothing to install)"
  else
    echo "[setup] state: would install"
  fi
  exit 0
fi

# --- a packed wheelhouse: an installed tree on PYTHONPATH, no pip ------------------------------
if [ "$SLIME_WH_FORM" = packed ]; then
  [ "$_slime_torch_install" = 0 ] || _slime_fail "$SLIME_WHEELHOUSE is a packed tree without torch; this python has ${_slime_torch_have:-no torch}, the $_slime_profile profile needs torch $_slime_torch_pin (use an image with it, or a wheels-form wheelhouse built without --no-torch)"
  export PYTHONPATH="$SLIME_ROOT:$SLIME_WH_SITE${PYTHONPATH:+:$PYTHONPATH}"
  python -c 'import slime' 2>/dev/null || _slime_fail "slime does not import with PYTHONPATH=$PYTHONPATH (unpacked from $SLIME_WHEELHOUSE)"
  return 0 2>/dev/null || exit 0
fi

if [ -f "$_slime_stamp" ] && [ "$(cat "$_slime_stamp")" = "$_slime_want" ] && python -c 'import slime' 2>/dev/null; then
  return 0 2>/dev/null || exit 0
fi

_slime_log="$SLIME_ROOT/.setup.log"
_slime_t0=$(date +%s)
echo "[setup] installing slime[$_slime_extras], $_slime_profile profile ($_slime_why), pins ${_slime_lock#"$SLIME_ROOT"/}${SLIME_WHEELHOUSE:+, from $SLIME_WHEELHOUSE}"
echo "[setup] $_slime_torch_plan"
# The last line before pip's silence (a minute or more on a fresh machine): what runs, where its output goes.
echo "[setup] pip is installing quietly (a minute or more on a fresh machine); its output: $_slime_log (tail -f it to follow)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
_slime_pip() {
  python -m pip install "${_slime_pip_src[@]}" "$@" >>"$_slime_log" 2>&1 \
    || { echo "[setup] pip install $* failed; see $_slime_log" >&2; tail -20 "$_slime_log" >&2; exit 1; }
}
: >"$_slime_log"
if [ "$_slime_torch_install" = 1 ]; then
  # torch first, alone: the cpu profile's CPU build from where the probe above found it, so that
  # no later requirement can pull a multi-GB CUDA build (the installed torch then meets the pin).
  # The gpu profile brings torchvision / torchaudio (what GPU images ship with torch) in the same step.
  if [ -n "$SLIME_WH_SECTIONS" ] && [ "$_slime_profile" = gpu ] && [[ ",$SLIME_WH_SECTIONS," != *,torch,* ]]; then
    _slime_fail "$SLIME_WHEELHOUSE was built with --no-torch, and this python has ${_slime_torch_have:-no torch}: the gpu profile needs torch $_slime_torch_pin (use an image with it, or rebuild the wheelhouse without --no-torch)"
  fi
  _slime_torch_reqs=("$_slime_torch_req")
  if [ "$_slime_profile" = gpu ]; then
    for _p in torchvision torchaudio; do
      _v=$(_slime_tool pin "$_slime_lock" "$_p"); [ -z "$_v" ] || _slime_torch_reqs+=("$_p==$_v")
    done
    _slime_pip -c "$_slime_lock" "${_slime_torch_reqs[@]}"
  else
    _slime_pip -c "$_slime_lock" "${_slime_torch_src[@]}" "${_slime_torch_reqs[@]}"
  fi
fi
_slime_pip -c "$_slime_lock" -e "$SLIME_ROOT${_slime_pip_extras:+[$_slime_pip_extras]}"
for _s in $_slime_nodeps; do
  # Installed from its exact pins alone (see the section's comment in the profile).
  _slime_reqs=$(mktemp)
  _slime_tool pins "$_slime_lock" --sections "$_s" >"$_slime_reqs"
  _slime_pip --no-deps -r "$_slime_reqs"
  rm -f "$_slime_reqs"
done
# The stamp records the torch installed now, which the next call finds (and keeps).
_slime_want="$_slime_want_base$(python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo none)"
echo "$_slime_want" >"$_slime_stamp" 2>/dev/null || echo "[setup] cannot write $_slime_stamp: the next call checks the pins again" >&2
echo "[setup] done in $(( $(date +%s) - _slime_t0 )) s: $(python -c 'import importlib.metadata as m; print(", ".join(f"{p} {m.version(p)}" for p in ("torch", "transformers")))')"
