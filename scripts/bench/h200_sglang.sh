#!/usr/bin/env bash
# Issue 11 on one H200: SGLang 0.5.17 rollout engines, proven with the project's own set-up.
#
#   bash scripts/bench/h200_sglang.sh OUT_DIR WHEELHOUSE [PHASE ...]      phases (default: all, in this order):
#     (always)    source scripts/setup_env.sh with SLIME_VENV=none SLIME_WHEELHOUSE=WHEELHOUSE (the GPU profile with
#                 the sglang extra, as the launcher sets it up for a cluster user; a second call installs nothing)
#     setup       versions, the plan of a second set-up, the two tiny checkpoints
#     tests       acceptance 1 and 3: tests/test_sglang_gpu.py (real SGLang through the engine interface: text and
#                 geo3k image prompts, one per call and in one batched call, image/text log-prob gaps vs HF fp32 with and without the multimodal-RoPE fix,
#                 requests without the run's key refused with the weights unchanged, CUDA-IPC updates, memory
#                 release/resume) and tests/test_sglang_gpu_faults.py (two engines on the GPU, one killed mid-rollout:
#                 no request lost or duplicated, restart); records the server's answers for the CPU fixture
#     engine      tests/test_sglang_gpu.py alone (409 s on a fresh machine: the first server start compiles)
#     faults      tests/test_sglang_gpu_faults.py alone
#     launcher    acceptance 2: examples/geo3k_vlm/run_geo3k_qwen35.sh, 3 colocated rollouts, FSDP + SGLang, tiny
#                 checkpoint (log-prob gaps after each sync, the engine parity check, memory with/without release,
#                 per-phase times)
#     throughput  acceptance 4: scripts/bench/sglang_rollout_bench.py throughput on the real-width scaled model
#                 (SLIME_THROUGHPUT_ARGS replaces the default extra flags "--official-cli", e.g.
#                 "--contenders ours sglang_alone" for a short call)
#     sync        tests/test_sglang_expert_load.py, then acceptance 5: scripts/bench/sglang_rollout_bench.py weight-sync
#                 on the same model (SLIME_SYNC_ARGS:
#                 extra flags, e.g. "--bucket-mb 2048 4096 --no-per-expert")
# WHEELHOUSE: from scripts/offline_bundle.sh with --extras test,sglang (see docs/results/h200_sglang.md for the
# build and carry commands); parts gathered in one folder.  OUT_DIR receives five files (the device tool brings
# back at most 8): summary.txt, figures.jsonl, metrics.jsonl (the launcher run), sglang_0.5.17_h200.jsonl.gz (the
# recorded server answers: gunzip into tests/fixtures/ for the CPU replay test) and logs.tar.gz (every log).
set -uo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../.."
OUT=${1:?usage: h200_sglang.sh OUT_DIR WHEELHOUSE [PHASE ...]}; WH=${2:?usage: h200_sglang.sh OUT_DIR WHEELHOUSE [PHASE ...]}
shift 2
PHASES=${*:-setup tests launcher throughput sync}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
LOGS=/tmp/h200-sglang-logs  # everything but the five result files; packed into OUT/logs.tar.gz on exit
mkdir -p "$LOGS"
pack() {
  cp "$LOGS/summary.txt" "$OUT/summary.txt" 2>/dev/null
  cp "$LOGS/figures.jsonl" "$OUT/figures.jsonl" 2>/dev/null
  cp "$LOGS/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
  [ -f "$LOGS/sglang_0.5.17_h200.jsonl" ] && gzip -c "$LOGS/sglang_0.5.17_h200.jsonl" >"$OUT/sglang_0.5.17_h200.jsonl.gz"
  tar czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude='*.safetensors' --exclude='checkpoints' --exclude='sglang_0.5.17_h200.jsonl' . 2>/dev/null
}
trap pack EXIT
trap 'exit 143' TERM  # a timeout's SIGTERM still packs the logs (through the EXIT trap)
export SLIME_VENV=none SLIME_WHEELHOUSE=$WH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 SLIME_GPU_FIGURES=$LOGS/figures.jsonl
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SCALED=/tmp/slime-scaled-qwen35
# The trimmed sglang-kernel of the wheelhouse has no FA3: triton attention (../shared/gpu/README.md).
SGLANG_FLAGS=(--sglang-attention-backend triton --sglang-mm-attention-backend triton_attn
              --sglang-sampling-backend pytorch --sglang-moe-runner-backend triton
              --sglang-disable-cuda-graph --sglang-skip-server-warmup)
now() { python3 -c 'import time; print(f"{time.time():.1f}")'; }
timed() {  # timed NAME COMMAND...: run it, log to OUT/NAME.log, note the seconds and exit code in summary.txt
  local name=$1 t0 t1 status; shift
  t0=$(now)
  "$@" >"$LOGS/$name.log" 2>&1; status=$?
  t1=$(now)
  echo "$name: exit $status in $(python3 -c "print(round($t1 - $t0, 1))") s" | tee -a "$LOGS/summary.txt"
  tail -n 3 "$LOGS/$name.log"
  return $status
}

engine_tests() {  # tests/test_sglang_gpu.py (acceptance 1 and the key check of 3); 409 s on a fresh machine
  SLIME_SGLANG_RECORD=$LOGS/sglang_0.5.17_h200.jsonl timed pytest_gpu \
    timeout 500 python3 -m pytest -s -rA -p no:cacheprovider tests/test_sglang_gpu.py
  grep -h '"check"' "$LOGS/figures.jsonl" 2>/dev/null | tail -n 20 | tee -a "$LOGS/summary.txt"
}
fault_tests() {  # tests/test_sglang_gpu_faults.py (acceptance 3): three server starts, 213 s after engine_tests
  timed pytest_gpu_faults timeout 420 python3 -m pytest -s -rA -p no:cacheprovider tests/test_sglang_gpu_faults.py
}

# The project's own set-up, sourced as the launcher sources it (a packed wheelhouse is a tree on PYTHONPATH,
# which only a sourced set-up exports to the commands below); a second call installs nothing.
t0=$(now)
# shellcheck disable=SC1091
source scripts/setup_env.sh >"$LOGS/setup.log" 2>&1
set +e  # setup_env.sh sets -e; a failing check below is reported, and the next one still runs
echo "setup_env (sourced): $(python3 -c "print(round($(now) - $t0, 1))") s; PYTHONPATH=$PYTHONPATH" | tee -a "$LOGS/summary.txt"
cp .setup.log "$LOGS/setup_env.log" 2>/dev/null

for phase in $PHASES; do
  case $phase in
  setup)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      echo "wheelhouse $WH: $(du -sb "$WH" | cut -f1) bytes"; } | tee -a "$LOGS/summary.txt"
    timed setup_again bash scripts/setup_env.sh --dry-run
    python3 -c 'import importlib.metadata as m; print({p: m.version(p) for p in ("torch", "transformers", "sglang", "sglang-kernel", "torch-memory-saver", "ray")})' \
      2>&1 | tee -a "$LOGS/summary.txt"
    timed checkpoints python3 -c 'from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint as e; print(e()); print(e(real_geometry=True, max_pixels=512 * 512))'
    ;;
  tests) engine_tests; fault_tests ;;  # each file bounded on its own: a hang in one leaves the other's results
  engine) engine_tests ;;
  faults) fault_tests ;;
  launcher)
    TINY=$(python3 -c 'from slime.checkpoints.tiny_qwen35 import ensure_tiny_checkpoint as e; print(e())')
    SLIME_SCRIPT_NUM_GPUS=1 SLIME_SCRIPT_MODEL_NAME=qwen3.5-tiny SLIME_SCRIPT_HF_CHECKPOINT="$TINY" \
    SLIME_SCRIPT_DATASET_NAME=examples/geo3k_vlm/data SLIME_SCRIPT_TRAIN_BACKEND=fsdp \
    SLIME_SCRIPT_ROLLOUT_BACKEND=sglang SLIME_SCRIPT_OUTPUT_DIR="$LOGS/run" \
      timed launcher timeout 420 bash examples/geo3k_vlm/run_geo3k_qwen35.sh --num-rollout 3 --rollout-batch-size 8 \
        --global-batch-size 64 --rollout-max-response-len 128 --eval-max-response-len 128 --no-progress-bar \
        --save /tmp/h200-sglang-ckpt --overwrite-output-dir "${SGLANG_FLAGS[@]}"
    if [ ! -s "$LOGS/run/command.sh" ]; then echo "command.sh: FAIL, missing or empty"
    elif grep -qi "api.key" "$LOGS/run/command.sh"; then echo "command.sh: FAIL, an API key flag is in it"
    else echo "command.sh: no API key in it"; fi | tee -a "$LOGS/summary.txt"
    python3 - "$LOGS/run/metrics.jsonl" <<'EOF' 2>&1 | tee -a "$LOGS/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "rollout/reward_mean" not in r:
        continue
    keys = [k for k in r if k.startswith(("parity/", "memory/", "perf/")) or k in (
        "train/logprob_abs_diff", "train/logprob_abs_diff_image", "train/logprob_abs_diff_text",
        "rollout/response_len_mean", "rollout/engine_failures")]
    print("step", r["step"], {k: round(r[k], 5) for k in sorted(keys)})
EOF
    ;;
  throughput)
    [ -f "$SCALED/config.json" ] || timed build_scaled python3 scripts/tools/make_scaled_qwen35.py "$SCALED" --force
    timed throughput timeout 480 python3 scripts/bench/sglang_rollout_bench.py throughput --model "$SCALED" \
      --json "$LOGS/bench.jsonl" --out "$LOGS" ${SLIME_THROUGHPUT_ARGS---official-cli}
    grep -h '"throughput"' "$LOGS/bench.jsonl" 2>/dev/null | tee -a "$LOGS/summary.txt"
    ;;
  sync)
    # the fast expert load against SGLang's real FusedMoE loader and Qwen3.5 load_weights (seconds; skipped on CPU)
    timed pytest_expert_load timeout 180 python3 -m pytest -q -rA -p no:cacheprovider tests/test_sglang_expert_load.py || true
    [ -f "$SCALED/config.json" ] || timed build_scaled python3 scripts/tools/make_scaled_qwen35.py "$SCALED" --force
    timed weight_sync timeout 420 python3 scripts/bench/sglang_rollout_bench.py weight-sync --model "$SCALED" \
      --json "$LOGS/bench.jsonl" --out "$LOGS" ${SLIME_SYNC_ARGS:-}
    grep -h '"weight_sync"' "$LOGS/bench.jsonl" 2>/dev/null | tee -a "$LOGS/summary.txt"
    ;;
  *) echo "unknown phase $phase (setup tests engine faults launcher throughput sync)"; exit 2 ;;
  esac
done
