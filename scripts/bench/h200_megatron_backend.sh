#!/usr/bin/env bash
# Issue 9's acceptance runs of the Megatron backend on one H200, by stage; logs and figures under OUT_DIR.
#
#   bash scripts/bench/h200_megatron_backend.sh OUT_DIR [STAGE ...]      (default stages: all, in this order)
#
# STAGE+STAGE runs those stages at the same time (e.g. launcher+learning: both are small models, so the GPU has
# room for both; their times are then measured side by side, not alone).  Every stage's timeout is cut to what
# is left of the device call (SLIME_CALL_S, default 590 s, counted from the script's start), so that the logs
# still come back: every *.log, and the launcher's run folder, are packed into OUT/logs.tar.gz on exit (the
# device tool brings back 8 files, 2 folders deep).
#
# Stages (each bounded by its own timeout, so that a device call of <= 600 s can run one or two):
#   site      unpack the wheels the image lacks onto /tmp/site (once per machine; every other stage needs it)
#   tests     tests/test_megatron_gpu.py: fixed geo3k batch (acceptance 1), distributed-optimizer resume,
#             offload/onload, export (figures -> OUT/figures.jsonl, log -> OUT/pytest_gpu.log)      ~4-6 min
#   qwen35    tests/test_qwen35_gpu.py's bf16 checks of the native model (issue 8): tiny real geometry vs HF,
#             35B-A3B layer shapes vs an fp32 HF reference (figures -> OUT/figures_qwen35.jsonl)           ~3-5 min
#   bench     scripts/bench/megatron_vs_fsdp.py (acceptance 4), 16 samples, 1 warm-up + 1 timed step per backend
#             -> OUT/bench.jsonl, OUT/profile/<backend>.txt for SLIME_BENCH_PROFILE's backends. The warm-up steps
#             compile fla's kernels for these shapes (caches on the machine's disk): the first time on a machine
#             Megatron's took 144.3 s, FSDP's 106.7 s (H200 run 4), so a first call runs `SLIME_BENCH_BACKENDS=megatron
#             SLIME_BENCH_PROFILE=none ... bench` (beside `learning`: the caches only), the next the whole
#             comparison, 260 s in run 4 (Megatron 0.96 s a step after a 3.3 s warm-up, FSDP 4.23 s)
#   learning  the colour task of tests/test_learning.py on one GPU, Megatron and FSDP (acceptance 3),
#             then OUT/fsdp_vs_megatron.png with python -m slime.utils.plot_runs                    ~6-8 min
#   launcher  run_geo3k_qwen35.sh with the tiny checkpoint, megatron + transformers, colocated: 3 rollouts
#             with a save, then --load and 2 more (acceptance 2); per-phase times and gaps -> OUT/launcher.txt
#
# What each stage needs on PYTHONPATH (/tmp/site), the image having torch 2.11, transformers, pytest:
#   - tests, bench: megatron-core + fla + tilelang: the bundle of docs/results/h200_megatron_qwen35.md,
#     MCORE_BUNDLE (default .gpu/mcore-bundle: site.sha256 + p*/site.tar.xz.part-*, 38 MB, one carry);
#   - learning, launcher: also ray, math-verify, datasets, wandb: the wheelhouse of
#     docs/results/h200_gpu_setup.md, WHEELHOUSE (default /tmp/wh: wheelhouse.tar.000 + .001, 121.5 MB,
#     two carries gathered there), its wheels installed with pip --no-index --no-deps --target /tmp/site.
# The site stage takes whichever of the two is present and can be re-run when the other arrives.
# Or, with SLIME_WHEELHOUSE=DIR set (a packed GPU-profile wheelhouse of scripts/offline_bundle.sh, extras
# test,megatron,sglang: the way a cluster user sets up), every call first sources scripts/setup_env.sh
# (SLIME_VENV=none, as the launcher does; a second call installs nothing) and the site stage only probes.
#
# Device calls that fit (64 MiB carry each; name .gpu in carry), as in H200 run 4 (h200_megatron_backend.md):
#   1-5. carry .gpu/wh-full/part-000 .. part-004, one a call:  mkdir -p /tmp/wh && cp .gpu/wh-full/part-00N/* /tmp/wh/
#   6. SLIME_BENCH_BACKENDS=megatron SLIME_BENCH_PROFILE=none SLIME_WHEELHOUSE=/tmp/wh \
#        bash scripts/bench/h200_megatron_backend.sh $OUT learning+bench                         (405 s in run 4)
#   7. SLIME_BENCH_PROFILE="megatron fsdp" SLIME_WHEELHOUSE=/tmp/wh \
#        bash scripts/bench/h200_megatron_backend.sh $OUT bench                                  (260 s in run 4)
#   tests (acceptance 1, runs 1-2), launcher (acceptance 2, run 3) alike: SLIME_WHEELHOUSE=/tmp/wh ... $OUT tests
set -uo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../.."
OUT=$(mkdir -p "${1:?usage: h200_megatron_backend.sh OUT_DIR [site|tests|qwen35|bench|learning|launcher ...]}" && cd "$1" && pwd)
shift
STAGES=("$@")
[ ${#STAGES[@]} -gt 0 ] || STAGES=(site tests qwen35 bench learning launcher)
MCORE_BUNDLE=${MCORE_BUNDLE:-.gpu/mcore-bundle}
WHEELHOUSE=${WHEELHOUSE:-/tmp/wh}
SITE=/tmp/site
export PYTHONPATH=$SITE:$PWD CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0
export SLIME_SKIP_SETUP=1 SLIME_GPU_FIGURES=$OUT/figures.jsonl NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
CALL_S=${SLIME_CALL_S:-590}
WORK=/tmp/h200-megatron-backend  # run folders that are not results (packed into logs.tar.gz)
mkdir -p "$WORK"
left() {  # left CAP: CAP seconds, or what is left of the device call if less (at least 30)
  local rest=$(( CALL_S - 5 - SECONDS ))
  [ "$rest" -lt "$1" ] || rest=$1
  echo $(( rest > 30 ? rest : 30 ))
}
pack() {
  local logs
  logs=$(cd "$OUT" && ls ./*.log 2>/dev/null)
  local run=()
  [[ -d "$WORK/launcher-run" && " ${STAGES[*]} " == *launcher* ]] && run=(-C "$WORK" launcher-run)  # this call's
  [ -n "$logs" ] || [ ${#run[@]} -gt 0 ] || return 0
  tar czf "$OUT/logs.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.distcp' \
    -C "$OUT" $logs "${run[@]}" && (cd "$OUT" && rm -f $logs)
}
BG_PIDS=()  # stages running side by side (STAGE+STAGE)
stop_stages() {  # a SIGTERM (the call's limit) stops side-by-side stages too, then packs (the EXIT trap)
  local pid
  for pid in "${BG_PIDS[@]}"; do pkill -TERM -P "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done
  wait
  exit 143
}
trap pack EXIT
trap stop_stages TERM
status=0
if [ -n "${SLIME_WHEELHOUSE:-}" ]; then
  export SLIME_VENV=none SLIME_SKIP_SETUP=0  # set up as a user would (the launcher stage's set-up then installs nothing)
  # shellcheck disable=SC1091
  source scripts/setup_env.sh >>"$OUT/setup_env.log" 2>&1 || { echo "setup_env.sh failed:"; tail -n 20 "$OUT/setup_env.log"; exit 3; }
  set +e  # setup_env.sh sets -e; a failing stage is reported and the next one still runs
  [ -s "$OUT/setup_env.log" ] || rm -f "$OUT/setup_env.log"
fi

stage_site() {
  mkdir -p "$SITE"
  [ -n "${SLIME_WHEELHOUSE:-}" ] && { probe; return; }
  if [ ! -f "$SITE/.mcore" ] && [ -f "$MCORE_BUNDLE/site.sha256" ]; then
    cat "$MCORE_BUNDLE"/p*/site.tar.xz.part-* > /tmp/mcore.tar.xz
    echo "$(cat "$MCORE_BUNDLE/site.sha256")  /tmp/mcore.tar.xz" | sha256sum -c --quiet || { echo "mcore bundle incomplete"; return 3; }
    xz -dc -T0 /tmp/mcore.tar.xz | tar -C "$SITE" -xf - && touch "$SITE/.mcore" && rm -f /tmp/mcore.tar.xz
  fi
  if [ ! -f "$SITE/.wheels" ] && [ -f "$WHEELHOUSE/wheelhouse.tar.001" ]; then
    mkdir -p /tmp/wh-wheels
    cat "$WHEELHOUSE"/wheelhouse.tar.* | tar -C /tmp/wh-wheels -xf - || { echo "wheelhouse parts incomplete"; return 3; }
    # The image's transformers 5.17.0 / tokenizers stay (the version the native model was proven with;
    # the wheelhouse's 5.12.1 is SGLang's pin, and SGLang is not used here).
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      $(ls /tmp/wh-wheels/*.whl | grep -v -E '/(transformers|tokenizers)-') && touch "$SITE/.wheels"
  fi
  probe
}

probe() {
  python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, torch.cuda.get_device_name(), "CUDA_HOME ok" if __import__("os").path.isdir("/usr/local/cuda") else "no CUDA_HOME")
for name in ("megatron.core", "fla", "tilelang", "transformers", "ray", "math_verify"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - a probe
        print(name, "MISSING:", type(e).__name__, e)
PY
  ls "$SITE"/.mcore "$SITE"/.wheels 2>/dev/null
  return 0
}

stage_tests() {
  timeout "$(left 560)" python3 -m pytest -s -rA -p no:cacheprovider tests/test_megatron_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
  return "${PIPESTATUS[0]}"
}

stage_qwen35() {  # issue 8's bf16 checks: tiny real geometry vs HF, 35B-A3B layer shapes vs an fp32 reference
  SLIME_GPU_FIGURES=$OUT/figures_qwen35.jsonl timeout "$(left 400)" python3 -m pytest -s -rA -p no:cacheprovider \
    tests/test_qwen35_gpu.py -k "35b or (tiny_realgeo_matches_hf and bf16)" 2>&1 | tee "$OUT/pytest_qwen35.log"
  return "${PIPESTATUS[0]}"
}

stage_bench() {
  # 16 samples (22,554 tokens) a step, one timed step each after one warm-up, so that both backends fit one
  # device call of 600 s: in run 3 (32 samples) the FSDP backend had not finished its warm-up, 2 timed and
  # 1 profiled step 200 s after its start; run 4 showed its warm-up step alone takes 106.7 s (fla's kernels
  # compiled in its process), then 4.23 s a step at 16 samples.
  # SLIME_BENCH_BACKENDS picks the backends (default both), SLIME_BENCH_PROFILE the profiled ones (default
  # megatron; "none": no profile, e.g. in a call that only warms the kernel caches).
  local profile=(--profile "$OUT/profile" --profile-backends ${SLIME_BENCH_PROFILE:-megatron})
  [ "${SLIME_BENCH_PROFILE:-}" = none ] && profile=()
  timeout "$(left 560)" python3 scripts/bench/megatron_vs_fsdp.py --json "$OUT/bench.jsonl" "${profile[@]}" \
    --samples 16 --warmup 1 --steps 1 --backends ${SLIME_BENCH_BACKENDS:-megatron fsdp} --workdir /tmp/bench-megatron-vs-fsdp 2>&1 | tee "$OUT/bench.log"
  return "${PIPESTATUS[0]}"
}

stage_learning() {  # the two backends' runs at the same time (each a small model; their own processes)
  mkdir -p "$OUT/learning"
  local b rc=0 pids=()
  for b in fsdp megatron; do
    SLIME_TEST_ARTIFACTS=$OUT/learning timeout "$(left 580)" python3 -m pytest -s -rA -p no:cacheprovider \
      tests/test_learning.py -k "one_gpu and $b" >"$OUT/pytest_learning_$b.log" 2>&1 &
    pids+=($!)
  done
  for b in "${pids[@]}"; do wait "$b" || rc=$?; done
  for b in fsdp megatron; do echo "--- $b:"; grep -E "rewards per rollout|passed|failed|Error" "$OUT/pytest_learning_$b.log" | tail -n 4; done
  python3 -m slime.utils.plot_runs "$OUT/learning/colour-fsdp/out" "$OUT/learning/colour-megatron/out" \
    --labels FSDP Megatron --title "colour task on one H200: same seed and flags" -o "$OUT/fsdp_vs_megatron.png"
  # the device tool brings back 8 files, 2 folders deep: the runs' metrics flat, their driver logs packed
  for b in fsdp megatron; do
    cp "$OUT/learning/colour-$b/out/metrics.jsonl" "$OUT/colour_gpu_${b}_metrics.jsonl"
    cp "$OUT/learning/colour-$b/driver.log" "$OUT/driver_$b.log"
  done 2>/dev/null
  rm -rf "$OUT/learning"
  return "$rc"
}

stage_launcher() {
  local tiny run ckpt rc
  tiny=$(python3 scripts/tools/make_tiny_qwen35.py | tail -n 1)
  run=$WORK/launcher-run; ckpt=$WORK/launcher-ckpt; rm -rf "$run" "$ckpt"
  launch() {  # launch SECONDS ARGS...
    local limit=$1; shift
    SLIME_SCRIPT_NUM_GPUS=1 SLIME_SCRIPT_MODEL_NAME=qwen3.5-tiny SLIME_SCRIPT_HF_CHECKPOINT="$tiny" \
    SLIME_SCRIPT_DATASET_NAME=examples/geo3k_vlm/data SLIME_SCRIPT_TRAIN_BACKEND=megatron \
    SLIME_SCRIPT_ROLLOUT_BACKEND=transformers SLIME_SCRIPT_OUTPUT_DIR="$run" \
      timeout "$limit" bash examples/geo3k_vlm/run_geo3k_qwen35.sh --rollout-batch-size 8 --global-batch-size 64 \
        --rollout-max-response-len 128 --eval-max-response-len 128 --eval-interval 100 --no-progress-bar \
        --save "$ckpt" --save-interval 3 "$@"
  }
  # the first run compiles fla's and the engine's kernels for the tiny shapes (the FSDP + SGLang launcher's
  # first step took 108 s); the resume gets what is left of a 600 s device call
  launch "$(left 360)" --num-rollout 3 >"$OUT/launcher_first.log" 2>&1; rc=$?
  tail -n 3 "$OUT/launcher_first.log"
  if [ "$rc" -eq 0 ]; then
    launch "$(left 600)" --num-rollout 5 --load "$ckpt" \
      >"$OUT/launcher_resume.log" 2>&1; rc=$?
    tail -n 3 "$OUT/launcher_resume.log"
  fi
  python3 - "$run/metrics.jsonl" <<'PY' 2>&1 | tee "$OUT/launcher.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    perf = {k.split("/")[1]: round(v, 2) for k, v in r.items() if k.startswith("perf/")}
    keys = ("rollout/reward_mean", "rollout/response_len_mean", "train/grad_norm", "train/logprob_abs_diff",
            "train/logprob_abs_diff_image", "train/logprob_abs_diff_text", "train/micro_batches", "eval/geo3k/accuracy")
    print("step", r["step"], {k: round(r[k], 5) for k in keys if k in r}, perf)
PY
  grep -h "resumed from\|done. Output" "$OUT"/launcher_*.log | tee -a "$OUT/launcher.txt"
  cp "$run/metrics.jsonl" "$OUT/launcher_metrics.jsonl" 2>/dev/null
  return "$rc"
}

run_stage() {  # run_stage NAME: one stage, timed, its exit status noted in stages.txt
  local start rc
  echo "=== stage $1 ($(date +%T))"
  start=$(date +%s)
  "stage_$1"; rc=$?
  echo "=== stage $1: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.txt"
  return "$rc"
}

for stage in "${STAGES[@]}"; do
  if [[ $stage == *+* ]]; then  # side by side: each one's console into OUT/stage_NAME.log, shown when all end
    BG_PIDS=(); IFS=+ read -r -a together <<<"$stage"
    for one in "${together[@]}"; do run_stage "$one" >"$OUT/stage_$one.log" 2>&1 & BG_PIDS+=($!); done
    for pid in "${BG_PIDS[@]}"; do wait "$pid" || status=$?; done
    BG_PIDS=()
    for one in "${together[@]}"; do tail -n 25 "$OUT/stage_$one.log"; done
  else
    run_stage "$stage" || status=$?
  fi
done
exit "$status"
