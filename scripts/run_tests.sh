#!/usr/bin/env bash
# Set up the environment (scripts/setup_env.sh) and run the test suite. Extra arguments go to pytest.
#   bash scripts/run_tests.sh                 # everything (CPU-only; GPU tests skip themselves)
#   bash scripts/run_tests.sh -k rm_hub -x    # a subset
set -euo pipefail
SLIME_ROOT="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$SLIME_ROOT/scripts/setup_env.sh"
cd "$SLIME_ROOT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0
exec python -m pytest "$@"
