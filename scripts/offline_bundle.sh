#!/usr/bin/env bash
# Build a wheelhouse of the GPU profile for air-gapped nodes (scripts/tools/offline_bundle.py):
#   bash scripts/offline_bundle.sh OUTDIR [--extras ...] [--no-torch] [--have FREEZE] [--form wheels|packed] [--part-size 45M]
#   bash scripts/offline_bundle.sh --help      what each form leaves out
# Needs Python >= 3.11 with pip and a package index; installs nothing here.
set -euo pipefail
exec "${SLIME_BUNDLE_PYTHON:-python3}" "$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)/tools/offline_bundle.py" "$@"
