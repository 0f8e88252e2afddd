#!/usr/bin/env bash
# Issue 24 on one H200: the recipe at its real widths and SGLang's defaults.
#
#   bash scripts/bench/h200_real_width.sh start OUT_DIR WHEELHOUSE [PHASE ...]   run the phases in the background
#   bash scripts/bench/h200_real_width.sh wait OUT_DIR SECONDS                  wait up to SECONDS, then pack the logs
#   bash scripts/bench/h200_real_width.sh run OUT_DIR WHEELHOUSE [PHASE ...]     the phases in the foreground
#
# A device call ends after 10 minutes, but a process in its own session outlives the call while the machine stays
# warm (30 s between calls): `start` returns at once, then back-to-back `wait` calls bring the logs home.
# Phases (default: all, in this order); each runs under a timeout and notes its seconds in summary.txt:
#   build       the real-width scaled checkpoint (scripts/models/qwen3.5-35B-A3B-scaled.sh: 4 layers, 128 experts)
#   check       the launcher's GPU command through the parser (--check-only)
#   before      issue 30 item 2: the launcher at the recipe's sizes with one sample per micro-batch, 2 rollouts; it,
#               after, after-none, r3, freeze and learn (SLIME_LEARN_SKIP) keep the old-log-prob pass
#               (SLIME_SCRIPT_SKIP_ACTOR_FORWARD=0); the other launcher phases run the launcher's default (no pass)
#   after       the same command with the launcher's default packing, 3 rollouts (perf/train_* sub-phases each); with
#               SLIME_AFTER_DISPATCHER, else the dispatcher this run's bench phase found faster where it ran both with
#               the pass (SLIME_BENCH_VARIANTS), else the launcher's (all-gather at EP = 1)
#   after-none  after with SLIME_SCRIPT_RECOMPUTE=none (no activation recomputation), 3 rollouts
#   after-skip  after with --skip-actor-forward-only (the old log-probs from the training forward: no old-log-prob
#               pass; the launcher's default since the sixth run), 3 rollouts; after-skip-none: the same with SLIME_SCRIPT_RECOMPUTE=none
#   bench       scripts/bench/megatron_vs_fsdp.py, Megatron alone on the scaled checkpoint, launcher-shaped samples
#               (128 a step, responses 32-512 tokens): the compute of a launcher step on this card at the launcher's
#               pack size, with the old-log-prob pass unless a variant says --no-old-log-probs, for each variant of
#               SLIME_BENCH_VARIANTS (NAME=FLAGS;... default: full recompute, new samples every step, the all-gather
#               dispatcher, with the pass and without it: after's and after-skip's compute; the fifth run's variants
#               were the same samples each step and --moe-token-dispatcher-type alltoall), then the benchmark's own
#               step (16k-token packs on 120 GiB+, 8k below; no old-log-prob pass, no recompute;
#               SLIME_BENCH_REFERENCE=0 skips it)
#   learn       issue 30 item 3: the colour task at real width through the production pair, R3 + TIS, 20 rollouts
#   r3          the after command with --use-rollout-routing-replay --use-tis, 3 rollouts
#   freeze      the after command with the vision tower frozen (--freeze-params-name-list 'model\.visual\.') and
#               dynamic sampling (nonzero_std_with_fallback, 24 prompts a round, 2 rounds), 3 rollouts: the sync time
#               and tensors sent against the after run's, and the dynamic-sampling metrics
#   floor       scripts/bench/parity_floor.py: engine vs HF fp32 / bf16 / forced routes / Megatron, by component
#   e2e         the launcher with only the recipe's variables: Megatron + SGLang (its defaults), colocated,
#               --rollout-batch-size 16 --global-batch-size 128 --rollout-max-response-len 512, 5 rollouts, a save
#   resume      the same command with --load of that save, 2 more rollouts
#   refuse      the e2e launch with SGLang's multimodal-RoPE bug left in: the parity gate must stop it before step 0
#   throughput  scripts/bench/sglang_rollout_bench.py throughput: ours vs sglang.Engine at SGLang's defaults
#   mtp         item 5: the same with --speculative mtp (EAGLE drafting with the checkpoint's MTP layer), then mtp-sync
#   mtp-sync    scripts/bench/mtp_sync.py: gap and acceptance length before / after a sync, no MTP vs MTP
#   mtp-recipe  ours alone at the recipe's rollout size (128 prompts x 512 tokens), without and with MTP
#               (SLIME_MTP_RECIPE_SPECS: which of the two, default "none mtp")
#   mtp-e2e     the e2e launcher run with SLIME_SCRIPT_SPECULATIVE=mtp, 3 rollouts (not in the default list)
#   vision      scripts/bench/vision_tower.py: the vision tower's forward + backward at the launcher's shapes, SDPA per
#               image against the varlen path, side by side (vision.jsonl; not in the default list)
#   gpu-tests   pytest on this card of the GPU tests that prove the background onload of the optimizer state
#               (SLIME_GPU_TESTS: the test ids; not in the default list)
# Results in OUT_DIR: summary.txt, figures.jsonl, bench.jsonl (throughput), mtp.jsonl (mtp_sync), metrics.jsonl (the
# e2e + resume run), logs.tar.gz.
set -uo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../.."
MODE=${1:?usage: h200_real_width.sh start|wait|run OUT_DIR ...}; OUT=${2:?OUT_DIR}; shift 2
LOGS=/tmp/h200-real-width
mkdir -p "$OUT" "$LOGS"; OUT=$(cd "$OUT" && pwd)
pack() {
  cp "$LOGS/summary.txt" "$LOGS/figures.jsonl" "$LOGS/bench.jsonl" "$LOGS/mtp.jsonl" "$LOGS/bench-compute.jsonl" \
    "$LOGS/vision.jsonl" "$OUT/" 2>/dev/null
  cp "$LOGS/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
  cp "$LOGS/learn_reward_curve.png" "$OUT/" 2>/dev/null
  cp "$LOGS/profile/megatron.txt" "$OUT/bench-profile.txt" 2>/dev/null
  tar czf "$OUT/logs.tar.gz" -C "$LOGS" --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.pt' . 2>/dev/null
}
case $MODE in
  stop)
    [ -f "$LOGS/pid" ] && kill -- -"$(cat "$LOGS/pid")" 2>/dev/null; sleep 5; pack; echo stopped; exit 0 ;;
  start)
    [ -f "$LOGS/pid" ] && kill -0 "$(cat "$LOGS/pid")" 2>/dev/null && { echo "already running"; exit 1; }
    setsid nohup bash "$0" run "$LOGS/out" "$@" >"$LOGS/driver.log" 2>&1 < /dev/null &
    echo $! >"$LOGS/pid"; echo "started $(cat "$LOGS/pid")"; exit 0 ;;
  wait)
    SECONDS_LEFT=${1:?SECONDS}; t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$SECONDS_LEFT" ] && kill -0 "$(cat "$LOGS/pid")" 2>/dev/null; do sleep 5; done
    kill -0 "$(cat "$LOGS/pid")" 2>/dev/null && echo "still running" || echo "finished"
    pack; tail -n 30 "$LOGS/summary.txt"; exit 0 ;;
  run) ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac

WH=${1:?WHEELHOUSE}; shift
PHASES=${*:-build check before after learn r3 refuse throughput floor e2e resume mtp mtp-recipe}
trap pack EXIT
trap 'exit 143' TERM
export SLIME_VENV=none SLIME_WHEELHOUSE=$WH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 SLIME_GPU_FIGURES=$LOGS/figures.jsonl
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}  # fla enables its tilelang backend only when it finds nvcc
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SCALED=/tmp/slime-scaled-qwen35-e128
RUN=$LOGS/run
now() { date +%s.%N; }
timed() {  # timed NAME COMMAND...: run it, log to LOGS/NAME.log, note seconds and exit code in summary.txt
  local name=$1 t0 status; shift
  t0=$(now)
  "$@" >"$LOGS/$name.log" 2>&1; status=$?
  echo "$name: exit $status in $(python3 -c "print(round($(now) - $t0, 1))") s" | tee -a "$LOGS/summary.txt"
  tail -n 3 "$LOGS/$name.log"
  return $status
}
launcher() {  # launcher SECONDS FLAGS...: the recipe as a user runs it on one GPU, the scaled model's file, no --sglang-* flag
  local limit=$1; shift  # RUN_DIR (default $RUN), SPECULATIVE (off), CKPT ($SCALED), DATA (geo3k), SKIP (the
  # launcher's SLIME_SCRIPT_SKIP_ACTOR_FORWARD: empty = its default) from the caller
  SLIME_SCRIPT_SKIP_ACTOR_FORWARD="${SKIP:-}" SLIME_SCRIPT_NUM_GPUS=1 SLIME_SCRIPT_MODEL_NAME=Qwen3.5-35B-A3B-scaled SLIME_SCRIPT_HF_CHECKPOINT="${CKPT:-$SCALED}" \
  SLIME_SCRIPT_DATASET_NAME="${DATA:-examples/geo3k_vlm/data}" SLIME_SCRIPT_OUTPUT_DIR="${RUN_DIR:-$RUN}" \
  SLIME_SCRIPT_SPECULATIVE="${SPECULATIVE:-off}" \
    timeout "$limit" bash examples/geo3k_vlm/run_geo3k_qwen35.sh --rollout-batch-size 16 --global-batch-size 128 \
      --rollout-max-response-len 512 --save-interval 5 --no-progress-bar "$@"
}
faster_dispatcher() {  # the dispatcher of the faster new-samples bench variant with the pass (tokens/s); none without both
  python3 - "$LOGS/bench-compute.jsonl" <<'EOF' 2>/dev/null
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rate = {r["dispatcher"]: r["tokens_per_s"] for r in rows
        if r.get("fresh_lengths") and r.get("old_log_probs") and "dispatcher" in r}
if {"alltoall", "allgather"} <= set(rate):
    print(max(("alltoall", "allgather"), key=rate.get))
EOF
}
summarize_run() {  # summarize_run [RUN_DIR]
  python3 - "${1:-$RUN}/metrics.jsonl" <<'EOF' 2>&1 | tee -a "$LOGS/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keys = [k for k in r if k.startswith(("parity/", "memory/", "perf/", "train/tis_")) or k in (
        "train/logprob_abs_diff", "train/logprob_abs_diff_image", "train/logprob_abs_diff_text", "train/grad_norm",
        "train/loss", "rollout/reward_mean", "rollout/response_len_mean", "rollout/engine_failures",
        "train/router_agreement", "train/micro_batches", "train/ppo_kl", "train/pg_clipfrac")]
    print("step", r.get("step"), {k: round(r[k], 5) for k in sorted(keys) if isinstance(r[k], (int, float))})
EOF
}

t0=$(now)
# shellcheck disable=SC1091
source scripts/setup_env.sh >"$LOGS/setup.log" 2>&1
set +e
{ echo "setup_env (sourced): $(python3 -c "print(round($(now) - $t0, 1))") s"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import importlib.metadata as m; print({p: m.version(p) for p in ("torch", "transformers", "sglang", "sglang-kernel", "megatron-core", "flash-linear-attention", "ray")})'
} 2>&1 | tee -a "$LOGS/summary.txt"

for phase in $PHASES; do
  case $phase in
  build)
    [ -f "$SCALED/config.json" ] || timed build_scaled python3 scripts/tools/make_scaled_qwen35.py "$SCALED" --force --layers 4 --experts 128
    # a checkpoint built before the MTP layer existed gets one (seed 0, as make_scaled_qwen35.py's)
    [ -f "$SCALED/mtp.safetensors" ] || timed add_mtp python3 -c "from slime.checkpoints.mtp import write_mtp_layer; \
write_mtp_layer('$SCALED', seed=0, device='cuda')" ;;
  floor)
    timed floor timeout 900 python3 scripts/bench/parity_floor.py --model "$SCALED" --json "$LOGS/figures.jsonl" \
      --run-dir "$LOGS/floor" ${SLIME_FLOOR_ARGS:-}
    grep -h '"check": "\(engine_start\|hf\|native\|engine_error\|native_error\)' "$LOGS/figures.jsonl" | cut -c1-600 | tee -a "$LOGS/summary.txt" >/dev/null ;;
  refuse)
    # The same launch with SGLang's multimodal-RoPE bug left in (SLIME_SGLANG_MROPE_FIX=0): the parity gate must stop
    # the run before step 0 (exit 1, EngineParityError naming the image gap).
    SLIME_SGLANG_MROPE_FIX=0 timed refuse launcher 900 --num-rollout 1 --output-dir "$LOGS/run-bug" --save "$LOGS/run-bug/ckpt"
    grep -a "EngineParityError\|engine parity" "$LOGS/refuse.log" | tail -n 3 | cut -c1-600 | tee -a "$LOGS/summary.txt" ;;
  check)
    # The launcher's GPU command through the parser on this machine (sglang installed): a refused flag stops here.
    timed check launcher 300 --num-rollout 1 --check-only ;;
  before|after|after-none|after-skip|after-skip-none)
    # Issue 30 item 2, the same command: upstream's one sample per micro-batch (before), the launcher's default
    # packing (after), the same without activation recomputation (after-none), without the old-log-prob pass
    # (after-skip, the launcher's default since the sixth run; the others keep the pass: SLIME_SCRIPT_SKIP_ACTOR_FORWARD
    # 0), without both (after-skip-none); 2 rollouts before, 3 the others, the final save without optimizer state
    # (deleted after).
    tokens=$([ "$phase" = before ] && echo 0 || echo "")
    recompute=$([[ $phase == *-none ]] && echo none || echo "")
    skip=$([[ $phase == after-skip* ]] && echo 1 || echo 0)
    # after*: SLIME_AFTER_DISPATCHER, else the dispatcher whose new-samples bench step with the pass was faster on
    # this card (where this run's bench compared both), else the launcher's; before: the launcher's
    dispatcher=$([ "$phase" = before ] || echo "${SLIME_AFTER_DISPATCHER:-$(faster_dispatcher)}")
    echo "$phase: --moe-token-dispatcher-type ${dispatcher:-unset, the launcher default}" | tee -a "$LOGS/summary.txt"
    SLIME_SCRIPT_MAX_TOKENS_PER_GPU=$tokens SLIME_SCRIPT_RECOMPUTE=$recompute SKIP=$skip RUN_DIR=$LOGS/run-$phase \
      timed "$phase" launcher 1200 --num-rollout "$([ "$phase" = before ] && echo "${SLIME_BEFORE_ROLLOUTS:-2}" || echo 3)" \
      --no-save-optim ${dispatcher:+--moe-token-dispatcher-type "$dispatcher"}
    summarize_run "$LOGS/run-$phase"; rm -rf "$LOGS/run-$phase/checkpoints"
    echo "$phase: batches refused by SGLang: $(grep -ac "refused a batched /generate" "$LOGS/$phase.log")" | tee -a "$LOGS/summary.txt" ;;
  bench)
    # The compute of a launcher step on this card, for the train phase's ratio to it (issue 30 item 2): Megatron alone,
    # the scaled checkpoint, 128 launcher-shaped samples (one 36x36-patch image, responses 32-512 tokens: about the
    # after run's 83-87k tokens), the old-log-prob pass and the launcher's pack size; then the benchmark's own step.
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    big=$([ "${gpu_mib:-0}" -ge 122880 ] && echo 1 || echo 0)
    shape=(--checkpoint "$SCALED" --backends megatron --samples 128 --response-min 32 --response-max 512 --warmup 1
      --steps 2 --json "$LOGS/bench-compute.jsonl" --workdir "$LOGS/bench-work")
    : >"$LOGS/bench-compute.jsonl"  # this run's rows only (faster_dispatcher reads them)
    if [ -n "${SLIME_BENCH_RECOMPUTE:-}" ]; then
      echo "bench: SLIME_BENCH_RECOMPUTE is gone; name the recompute in SLIME_BENCH_VARIANTS" | tee -a "$LOGS/summary.txt"
      continue
    fi
    # The fifth run compared the same / new samples and the two dispatchers (docs/results/h200_train_phase.md); now the
    # launcher's default dispatcher with and without the old-log-prob pass (after / after-skip's compute).
    default_variants="fresh-allgather=--recompute full --fresh-lengths --moe-token-dispatcher-type allgather --profile $LOGS/profile"
    default_variants+=";fresh-allgather-nopass=--recompute full --fresh-lengths --moe-token-dispatcher-type allgather --no-old-log-probs"
    variants=${SLIME_BENCH_VARIANTS:-$default_variants}
    IFS=';' read -ra variant_list <<<"$variants"
    set -f  # a variant's flags split on spaces, never globbed
    for variant in "${variant_list[@]}"; do
      [ -n "${variant// /}" ] || continue
      name=${variant%%=*}
      if [ "$name" = "$variant" ] || [ -z "$name" ] || [[ $name == *" "* ]]; then
        echo "bench: variant '$variant' is not NAME=FLAGS (NAME without spaces); skipped" | tee -a "$LOGS/summary.txt"
        continue
      fi
      # shellcheck disable=SC2086
      timed "bench_$name" timeout 600 python3 scripts/bench/megatron_vs_fsdp.py "${shape[@]}" --old-log-probs \
        --max-tokens-per-gpu "$([ "$big" = 1 ] && echo 8192 || echo 4096)" ${variant#*=}
    done
    set +f
    [ "${SLIME_BENCH_REFERENCE:-1}" = 0 ] || timed bench_reference timeout 600 python3 scripts/bench/megatron_vs_fsdp.py \
      "${shape[@]}" --recompute none --max-tokens-per-gpu "$([ "$big" = 1 ] && echo 16384 || echo 8192)"
    cut -c1-900 "$LOGS/bench-compute.jsonl" | tee -a "$LOGS/summary.txt" ;;
  r3)
    # The after command with R3 (the engine's routes replayed in every training forward) and TIS: router agreement
    # 1, and the gap with R3 on against the after run's (R3 off).
    # R3 makes the launcher recompute selectively (not full), so its micro-batches are halved to keep the memory.
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    # The pass is kept (SKIP=0): the router agreement is measured there.
    SLIME_SCRIPT_MAX_TOKENS_PER_GPU=$([ "${gpu_mib:-0}" -ge 122880 ] && echo 4096 || echo 2048) SKIP=0 RUN_DIR=$LOGS/run-r3 timed r3 launcher 1200 --num-rollout 3 --no-save-optim \
      --use-rollout-routing-replay --use-tis
    summarize_run "$LOGS/run-r3"; rm -rf "$LOGS/run-r3/checkpoints" ;;
  freeze)
    # Issue 30 item 1: one run with a frozen vision tower (its weights cross the sync once, at the engines' start) and
    # dynamic sampling. A random model scores 0 on geo3k, so every group has zero std: the fallback filter spends its
    # 2 rounds of 24 prompts (aborting the second round's groups still in flight), then fills the batch with the
    # best rejected groups; perf/sync_time_s and weight_sync/tensors_sent of steps 1-2 against the after run's.
    SKIP=0 RUN_DIR=$LOGS/run-freeze timed freeze launcher 1200 --num-rollout 3 --no-save-optim \
      --freeze-params-name-list 'model\.visual\.' --over-sampling-batch-size 24 \
      --dynamic-sampling-filter-path nonzero_std_with_fallback --dynamic-sampling-max-rounds 2
    summarize_run "$LOGS/run-freeze"; rm -rf "$LOGS/run-freeze/checkpoints"
    python3 - "$LOGS/run-freeze/metrics.jsonl" "$LOGS/run-after/metrics.jsonl" <<'PY' 2>&1 | tee -a "$LOGS/summary.txt"
import json, sys
for path in sys.argv[1:]:
    try:
        rows = [json.loads(line) for line in open(path)]
    except OSError:
        continue
    for r in rows:
        keys = [k for k in r if k.startswith(("weight_sync/", "rollout/dynamic_", "perf/sync"))]
        print(path.split("/")[-2], "step", r.get("step"), {k: r[k] for k in sorted(keys)})
PY
    ;;
  learn)
    # Issue 30 item 3: the colour task (scripts/harness/colour_task.py) through the launcher's production pair at real width
    # (Megatron + SGLang at its defaults, colocated, R3 and TIS on), from a colour-prior copy of the scaled model
    # (scripts/bench/colour_prior.py); tests/test_learning.py's hyper-parameters but one optimizer step per rollout
    # (the launcher shuffles, so only the whole rollout holds each colour equally often) and an lr for a 2048-wide
    # model. 5e-5 (the H100 run of 2026-12-06, tower frozen) made the policy deterministic per prompt within 2 steps of
    # its warm-up (zero reward std, reward 1/3: one colour for every image), so the default is 10x lower.
    # The parity check probes 6 prompts: the colour data has 6 rows (its default of 8 stopped the first GPU run).
    [ -f "$LOGS/colour/checkpoint/config.json" ] || timed colour_prior python3 scripts/bench/colour_prior.py \
      --model "$SCALED" --out "$LOGS/colour" --temperature 0.5
    grep -h '"colour_prior"' "$LOGS/colour_prior.log" | cut -c1-400 | tee -a "$LOGS/summary.txt"
    learn_flags=(--num-rollout "${SLIME_LEARN_ROLLOUTS:-20}" --rollout-batch-size 6 --n-samples-per-prompt 8
      --global-batch-size 48 --rollout-max-response-len 1 --rollout-temperature 0.5
      --custom-rm-path scripts.harness.colour_task:colour_reward --apply-chat-template-kwargs '{"enable_thinking": false}'
      --eps-clip 0.5 --eps-clip-high 1.0 --lr "${SLIME_LEARN_LR:-5e-6}" --lr-warmup-iters 4 --weight-decay 0
      --use-rollout-routing-replay --use-tis --no-save-optim --save-interval 1000 --engine-parity-prompts 6
      ${SLIME_LEARN_EXTRA:-})
    # SLIME_LEARN_SKIP (default 0: the pass, which measures the router agreement that item 3 logs; 1 or empty: none)
    CKPT=$LOGS/colour/checkpoint DATA=$LOGS/colour/colours.parquet SKIP=${SLIME_LEARN_SKIP-0} RUN_DIR=$LOGS/run-learn \
      timed learn launcher 1500 "${learn_flags[@]}"
    grep -a "multimodal-embedding flush\|flush_cache not found" "$LOGS/learn.log" | head -n 2 | cut -c1-400 | tee -a "$LOGS/summary.txt"
    grep -a "engine parity" "$LOGS/learn.log" | head -n 3 | cut -c1-400 | tee -a "$LOGS/summary.txt"
    # SGLang 0.5.17's batched-request race (the plugin's fix): how many batches it still refused
    echo "learn: batches refused by SGLang: $(grep -ac "refused a batched /generate" "$LOGS/learn.log"); fix warnings: $(grep -ac "batched requests that finish before SGLang" "$LOGS/learn.log")" | tee -a "$LOGS/summary.txt"
    # One device loan is all there is: if the parity gate (not the learning) stopped it, the gate's figures are in the
    # log and the run goes again with the vision tower frozen (a stale image path cannot widen the gap then), so the
    # curve is still taken (the summary says which happened).
    if grep -qa "EngineParityError" "$LOGS/learn.log"; then
      grep -a "EngineParityError" "$LOGS/learn.log" | tail -n 2 | cut -c1-600 | tee -a "$LOGS/summary.txt"
      echo "learn: the parity gate stopped it; again with the vision tower frozen" | tee -a "$LOGS/summary.txt"
      mv "$LOGS/run-learn" "$LOGS/run-learn-stopped"; rm -rf "$LOGS/run-learn-stopped/checkpoints"
      CKPT=$LOGS/colour/checkpoint DATA=$LOGS/colour/colours.parquet SKIP=${SLIME_LEARN_SKIP-0} RUN_DIR=$LOGS/run-learn timed learn_frozen \
        launcher 1500 "${learn_flags[@]}" --freeze-params-name-list 'model\.visual\.'
    fi
    grep -a "saved\|Traceback\|Error" "$LOGS/run-learn/"*.log "$LOGS/learn"*.log 2>/dev/null | grep -v "^.*DeprecationWarning" | tail -n 4 | cut -c1-300 | tee -a "$LOGS/summary.txt"
    summarize_run "$LOGS/run-learn"; rm -rf "$LOGS/run-learn/checkpoints"
    cp "$LOGS/run-learn/reward_curve.png" "$LOGS/learn_reward_curve.png" 2>/dev/null
    python3 scripts/bench/learn_summary.py "$LOGS/run-learn/metrics.jsonl" 2>&1 | tee -a "$LOGS/summary.txt" ;;
  e2e)
    timed e2e launcher 1500 --num-rollout 5 --overwrite-output-dir
    summarize_run ;;
  resume)
    # Two checkpoints of this model (45 GB each: bf16 weights, float32 main weights and Adam moments) do not fit the
    # machine's 64 GB disk: once the resumed run has loaded rollout 4's (its parity check runs after the load), the
    # harness deletes it, so that the run's final save fits.  A user with room keeps every checkpoint.
    ( for _ in $(seq 1 600); do
        if grep -qa "engine parity before the first update" "$LOGS/resume.log" 2>/dev/null; then
          rm -rf "$RUN/checkpoints/iter_0000004"; echo "deleted iter_0000004 after the resumed run loaded it" >>"$LOGS/summary.txt"; break
        fi; sleep 2; done ) &
    timed resume launcher 1200 --num-rollout 7 --load "$RUN/checkpoints"
    summarize_run ;;
  throughput)
    timed throughput timeout 1200 python3 scripts/bench/sglang_rollout_bench.py throughput --model "$SCALED" \
      --json "$LOGS/bench.jsonl" --out "$LOGS" ${SLIME_THROUGHPUT_ARGS---contenders ours sglang_alone}
    grep -h '"throughput"' "$LOGS/bench.jsonl" 2>/dev/null | tee -a "$LOGS/summary.txt" ;;
  mtp)
    timed mtp_throughput timeout 1200 python3 scripts/bench/sglang_rollout_bench.py throughput --model "$SCALED" \
      --json "$LOGS/bench.jsonl" --out "$LOGS/mtp" --speculative mtp ${SLIME_MTP_THROUGHPUT_ARGS---contenders ours sglang_alone}
    grep -h '"throughput"' "$LOGS/bench.jsonl" 2>/dev/null | grep '"speculative": "mtp"' | tee -a "$LOGS/summary.txt"
    ;&  # then mtp-sync
  mtp-sync)
    # The MTP server at the launcher's 0.7 ran out of memory at start-up on an 80 GB H100 (the run of 2026-12-06);
    # the throughput bench's standalone MTP server at 0.6 started there.
    gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    timed mtp_sync timeout 1500 python3 scripts/bench/mtp_sync.py --model "$SCALED" --json "$LOGS/mtp.jsonl" \
      --out "$LOGS/mtp-sync" --mem-fraction-static "$([ "${gpu_mib:-0}" -ge 122880 ] && echo 0.7 || echo 0.6)" \
      ${SLIME_MTP_SYNC_ARGS:-}
    grep -h '"mtp_sync' "$LOGS/mtp.jsonl" 2>/dev/null | cut -c1-700 | tee -a "$LOGS/summary.txt" ;;
  mtp-recipe)
    for spec in ${SLIME_MTP_RECIPE_SPECS:-none mtp}; do
      timed "mtp_recipe_$spec" timeout 900 python3 scripts/bench/sglang_rollout_bench.py throughput --model "$SCALED" \
        --json "$LOGS/bench.jsonl" --out "$LOGS/mtp-recipe-$spec" --speculative "$spec" --prompts 128 \
        --max-new-tokens 512 --contenders ours --direct-requests-per-call 32
    done
    grep -h '"throughput"' "$LOGS/bench.jsonl" 2>/dev/null | grep '"prompts": 128' | cut -c1-900 | tee -a "$LOGS/summary.txt" ;;
  mtp-e2e)
    # 3 rollouts with MTP in its own folder; no optimizer state in the final save (the disk holds 64 GB)
    RUN_DIR=$LOGS/run-mtp SPECULATIVE=mtp timed mtp_e2e launcher 1200 --num-rollout 3 --no-save-optim --overwrite-output-dir
    summarize_run "$LOGS/run-mtp"
    rm -rf "$LOGS/run-mtp/checkpoints" ;;
  vision)
    # The vision tower alone at the launcher's shapes (128 images of 36x36 patches, 6 a call), forward + backward:
    # transformers' SDPA per image against the varlen path (and each block compiled, partial fusion).
    : >"$LOGS/vision.jsonl"  # this run's rows only
    timed vision timeout 600 python3 scripts/bench/vision_tower.py --json "$LOGS/vision.jsonl"
    cat "$LOGS/vision.jsonl" >>"$LOGS/summary.txt" 2>/dev/null ;;
  gpu-tests)
    # shellcheck disable=SC2086
    timed gpu_tests timeout 900 python3 -m pytest -x -s -rA -p no:cacheprovider -m gpu ${SLIME_GPU_TESTS:-tests/test_host_offload.py \
      tests/test_megatron_gpu.py::test_offload_frees_gpu_memory_and_onload_restores_the_same_state}
    tail -n 5 "$LOGS/gpu_tests.log" >>"$LOGS/summary.txt" ;;
  *) echo "unknown phase $phase (build check before after after-none after-skip after-skip-none bench learn r3 freeze refuse throughput floor e2e resume mtp mtp-sync mtp-recipe mtp-e2e vision gpu-tests)" | tee -a "$LOGS/summary.txt" ;;
  esac
done
echo "all phases done" | tee -a "$LOGS/summary.txt"
