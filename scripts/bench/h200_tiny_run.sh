#!/usr/bin/env bash
# The launcher on one GPU with the tiny checkpoint: 3 rollouts, FSDP2 over NCCL, transformers
# engine on the GPU, colocated. Prints per-phase step times from metrics.jsonl.
#
# For an offline GPU image (the lent H200s): wheels the image lacks (ray + deps, math-verify + deps)
# are installed from WHEEL_DIR (default /tmp/whl) into /tmp/site first, when present.
#   bash scripts/bench/h200_tiny_run.sh [OUT_DIR] [extra trainer flags...]
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../.."
OUT_DIR=${1:-/tmp/h200-tiny}; shift || true
WHEEL_DIR=${WHEEL_DIR:-/tmp/whl}
mkdir -p "$OUT_DIR"

if ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEEL_DIR"/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SLIME_SKIP_SETUP=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
python3 -c 'import torch, transformers, ray; print("torch", torch.__version__, "transformers", transformers.__version__, "ray", ray.__version__, "cudnn", torch.backends.cudnn.version())' | tee -a "$OUT_DIR/gpu.txt"

TINY=$(python3 scripts/tools/make_tiny_qwen35.py | tail -n 1)
SLIME_SCRIPT_NUM_GPUS=1 SLIME_SCRIPT_MODEL_NAME=qwen3.5-tiny SLIME_SCRIPT_HF_CHECKPOINT="$TINY" \
SLIME_SCRIPT_DATASET_NAME=examples/geo3k_vlm/data SLIME_SCRIPT_TRAIN_BACKEND=fsdp \
SLIME_SCRIPT_ROLLOUT_BACKEND=transformers SLIME_SCRIPT_OUTPUT_DIR="$OUT_DIR/run" \
  bash examples/geo3k_vlm/run_geo3k_qwen35.sh --num-rollout 3 --rollout-batch-size 8 --global-batch-size 64 \
    --rollout-max-response-len 256 --eval-max-response-len 256 --no-progress-bar --save /tmp/h200-ckpt "$@" 2>&1 | tee "$OUT_DIR/run.log"

python3 - "$OUT_DIR/run/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    perf = {k.split("/")[1]: round(v, 2) for k, v in r.items() if k.startswith("perf/")}
    keys = ("rollout/reward_mean", "rollout/response_len_mean", "train/grad_norm", "train/logprob_abs_diff", "eval/geo3k/accuracy")
    print("step", r["step"], {k: round(r[k], 4) for k in keys if k in r}, perf)
EOF
