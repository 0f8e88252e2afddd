#!/usr/bin/env bash
# GPU set-up on an air-gapped node, from the image as it is: scripts/setup_env.sh installs the GPU
# profile from a wheelhouse (scripts/offline_bundle.sh) into the image's python, then the launcher
# runs 2 rollouts with the tiny checkpoint on one GPU (FSDP2 + transformers engine, colocated).
# Prints the set-up time, the wheelhouse size and per-step figures (docs/results/h200_gpu_setup.md).
#
#   bash scripts/bench/h200_gpu_setup.sh OUT_DIR WHEELHOUSE [extra trainer flags...]
set -euo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../.."
OUT=$(mkdir -p "$1" && cd "$1" && pwd); WH=$2; shift 2
export SLIME_VENV=none SLIME_WHEELHOUSE=$WH
now() { python3 -c 'import time; print(f"{time.time():.1f}")'; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import importlib.metadata as m, sys; print(sys.version.split()[0], {p: m.version(p) for p in ("torch", "transformers", "tokenizers", "triton", "numpy")})'
  echo "wheelhouse $WH: $(du -sb "$WH" | cut -f1) bytes ($(ls "$WH" | wc -l) files)"
} 2>&1 | tee "$OUT/before.txt"
bash scripts/setup_env.sh --dry-run 2>&1 | tee "$OUT/plan.txt"
t0=$(now)
bash scripts/setup_env.sh 2>&1 | tee "$OUT/setup.txt"
t1=$(now)
cp .setup.log "$OUT/setup.log"
{
  echo "setup_s $(python3 -c "print(round($t1 - $t0, 1))")"
  bash scripts/setup_env.sh --dry-run 2>&1 | tail -n 1   # a second call: up to date
  python3 -m pip check 2>&1 | tail -n 5 || true
  python3 -c 'import importlib.metadata as m; print({p: m.version(p) for p in ("torch", "transformers", "tokenizers", "ray", "math-verify", "datasets", "wandb", "slime")})'
} 2>&1 | tee "$OUT/summary.txt"

TINY=$(python3 scripts/tools/make_tiny_qwen35.py | tail -n 1)
t2=$(now)
set +e
SLIME_SCRIPT_NUM_GPUS=1 SLIME_SCRIPT_MODEL_NAME=qwen3.5-tiny SLIME_SCRIPT_HF_CHECKPOINT="$TINY" \
SLIME_SCRIPT_DATASET_NAME=examples/geo3k_vlm/data SLIME_SCRIPT_TRAIN_BACKEND=fsdp \
SLIME_SCRIPT_ROLLOUT_BACKEND=transformers SLIME_SCRIPT_OUTPUT_DIR="$OUT/run" \
  bash examples/geo3k_vlm/run_geo3k_qwen35.sh --num-rollout 2 --rollout-batch-size 8 --global-batch-size 64 \
    --rollout-max-response-len 128 --eval-max-response-len 128 --no-progress-bar --save /tmp/h200-ckpt "$@" \
    >"$OUT/run.log" 2>&1
status=$?
set -e
t3=$(now)
tail -n 5 "$OUT/run.log"
cp "$OUT/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null || true
{
  echo "launcher_exit $status launcher_s $(python3 -c "print(round($t3 - $t2, 1))")"
  python3 - "$OUT/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    perf = {k.split("/")[1]: round(v, 2) for k, v in r.items() if k.startswith("perf/")}
    keys = ("rollout/reward_mean", "rollout/response_len_mean", "train/pg_loss", "train/grad_norm", "train/logprob_abs_diff")
    print("step", r["step"], {k: round(r[k], 4) for k in keys if k in r}, perf)
EOF
} 2>&1 | tee -a "$OUT/summary.txt"
exit "$status"
