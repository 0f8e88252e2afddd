#!/usr/bin/env bash
#
# GRPO on Geometry3K for Qwen3.5-35B-A3B (VLM single-turn RL).
#
#   bash examples/geo3k_vlm/run_geo3k_qwen35.sh [extra trainer flags...]
#
# Extra flags are passed on to `python -m slime.train` and override the defaults below,
# e.g. `run_geo3k_qwen35.sh --num-rollout 2`.  With no GPU on the machine it runs the
# embedded default instead: a tiny random Qwen3.5 checkpoint (built on demand), the
# geo3k sample bundled in examples/geo3k_vlm/data, the transformers engine and the FSDP2
# trainer over gloo (SLIME_SCRIPT_TRAIN_BACKEND=megatron set explicitly: the Megatron trainer,
# data-parallel; SLIME_SCRIPT_ROLLOUT_BACKEND set explicitly: that engine, so sglang stops at once
# with the driver's reason instead of being replaced).  See examples/geo3k_vlm/README.md for every variable.
#
# Variables (defaults in brackets):
#   SLIME_SCRIPT_DATASET_NAME   [chenhegu/geo3k_imgurl] HF dataset name, local folder
#                               (train.parquet/test.parquet) or parquet file
#   SLIME_SCRIPT_NUM_GPUS       [8] GPUs on this node for trainers (and, colocated, engines)
#   SLIME_SCRIPT_EXTERNAL_RAY   [0] 1: join the running Ray cluster ($RAY_ADDRESS or auto)
#   SLIME_SCRIPT_MODEL_NAME     [Qwen3.5-35B-A3B] picks scripts/models/<lowercase name>.sh
#   SLIME_SCRIPT_HF_CHECKPOINT  [$HOME/models/$SLIME_SCRIPT_MODEL_NAME] HF checkpoint folder
#   SLIME_SCRIPT_TRAIN_BACKEND  [megatron] megatron | fsdp
#   SLIME_SCRIPT_ROLLOUT_BACKEND [sglang] sglang | transformers
#   SLIME_SCRIPT_SPECULATIVE    [off] mtp: SGLang drafts with the checkpoint's MTP layer, upstream's
#                               --sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2
#                               --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 3
#                               (the checkpoint must have its mtp.* tensors; the sglang engine only); on a
#                               card under 120 GiB also --sglang-mem-fraction-static 0.6 (0.7 otherwise)
#   SLIME_SCRIPT_MAX_TOKENS_PER_GPU [with megatron on 1 GPU: 8192 on a card of 120 GiB or more, 4096
#                               on a smaller one; else 0] tokens per packed micro-batch
#                               (--use-dynamic-batch-size --max-tokens-per-gpu N); 0: upstream's one
#                               sample per micro-batch (--micro-batch-size 1), the only batching a GDN
#                               model trains with where packing is not proven (TP, PP, CP or EP > 1)
#   SLIME_SCRIPT_RECOMPUTE      [megatron: full, selective with --use-rollout-routing-replay; fsdp: full]
#                               activation recomputation of the GPU recipe: full (upstream's
#                               --recompute-granularity full --recompute-method uniform --recompute-num-layers 1;
#                               fsdp: --gradient-checkpointing), selective (megatron only) or none (more memory,
#                               one forward less a micro-batch); --recompute-granularity among the extra
#                               arguments chooses instead (the two together are refused)
#   SLIME_SCRIPT_SKIP_ACTOR_FORWARD [auto] the GPU recipe's old-log-prob pass: empty/unset (auto) skips it
#                               (--skip-actor-forward-only) where a rollout step is one optimizer step and no extra
#                               argument needs it (--use-routing-replay without --use-rollout-routing-replay,
#                               --use-rollout-logprobs, --kl-coef with --normalize-advantages, --debug-rollout-only),
#                               and says why when it keeps it; 0: never (upstream's pass); 1: always (the driver
#                               refuses what the flag cannot run with; on the CPU default too).  Skipped,
#                               train/router_agreement is not logged (it is measured in the pass); an explicit
#                               --skip-actor-forward-only among the extra arguments wins over 0
#   SLIME_SCRIPT_OUTPUT_DIR     [outputs/geo3k-<model>-<time>] metrics, plot, checkpoints
#   SLIME_SCRIPT_FORCE_CPU      [0] 1: run the embedded CPU default even if GPUs exist
#   SLIME_SCRIPT_DRY_RUN        [0] 1: print the trainer command and exit
#   WANDB_API_KEY               set -> --use-wandb (project slime-geo3k-vlm)
# The switches (SLIME_SCRIPT_EXTERNAL_RAY, _FORCE_CPU, _DRY_RUN) take 0, 1 or empty/unset (0);
# any other value (true, yes, ...) stops the script with exit 2, as does a backend variable other
# than the two names it takes, a count (NUM_GPUS, MAX_TOKENS_PER_GPU) that is not a whole number
# (NUM_GPUS >= 1), or a SKIP_ACTOR_FORWARD other than 0, 1 or empty, on the CPU default too.
#
# Relative paths (in the variables above and in the path flags: --output-dir, --save, --load,
# --ref-load, --hf-checkpoint, --save-hf, --save-debug-rollout-data, --load-debug-rollout-data,
# --prompt-data, --eval-prompt-data) are taken from the directory the script is run from, not
# from the repository it changes to.
#
# With --check-only among the extra arguments the script only checks the flags (the driver's
# "slime: flags OK ..." or its error): no folder probe, no download, no run, no resume line.
# With -h or --help it prints this text, then slime's flags, and exits 0 (nothing is checked or run).

set -euo pipefail

SLIME_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." && pwd)"
for arg in "$@"; do
   case "$arg" in
      -h|--help)
         # The header above (usage and variables), then the trainer's flags, and nothing after.
         sed -n '3,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
         printf "%s\n\n" "Trainer flags (the extra arguments, passed on to python -m slime.train, which the script calls):"
         # shellcheck disable=SC1091
         source "$SLIME_DIR/scripts/setup_env.sh" >&2
         cd "$SLIME_DIR" && exec python -m slime.train --help ;;
   esac
done
# The switches: 0, 1 or empty/unset (0); anything else (true, yes, false...) is refused rather than
# read as one or the other.
for var in SLIME_SCRIPT_EXTERNAL_RAY SLIME_SCRIPT_FORCE_CPU SLIME_SCRIPT_DRY_RUN; do
   case "${!var:-}" in
      ""|0|1) ;;
      *) echo "[geo3k] $var=${!var}: expected 0 or 1 (or empty/unset, meaning 0)" >&2; exit 2 ;;
   esac
done
# The variables this script reads (after SLIME_SCRIPT_); any other SLIME_SCRIPT_* is a typo
# (SLIME_SCRIPT_NUMGPUS): refused, not ignored.
KNOWN_VARS=(DATASET_NAME NUM_GPUS EXTERNAL_RAY MODEL_NAME HF_CHECKPOINT TRAIN_BACKEND ROLLOUT_BACKEND SPECULATIVE
            MAX_TOKENS_PER_GPU RECOMPUTE SKIP_ACTOR_FORWARD FORCE_CPU OUTPUT_DIR DRY_RUN)
for var in $(compgen -e | grep '^SLIME_SCRIPT_' || true); do
   if [[ " ${KNOWN_VARS[*]} " != *" ${var#SLIME_SCRIPT_} "* ]]; then
      echo "[geo3k] $var is not a variable of this script; it reads SLIME_SCRIPT_{$(IFS=,; echo "${KNOWN_VARS[*]}")}" >&2
      exit 2
   fi
done
# The backends by name, refused here naming the variable (the driver would name its flag, --train-backend);
# another trainer or engine class goes in the extra arguments (--train-backend pkg.mod:Class).
for check in "TRAIN_BACKEND megatron fsdp" "ROLLOUT_BACKEND sglang transformers"; do
   read -r var first second <<<"$check"; var=SLIME_SCRIPT_$var
   case "${!var:-$first}" in
      "$first"|"$second") ;;
      *) echo "[geo3k] $var=${!var}: expected $first or $second" >&2; exit 2 ;;
   esac
done
# The counts, refused here naming the variable (the driver would name its flag, --actor-num-gpus-per-node), on the
# CPU default too (which reads neither or only NUM_GPUS): a typo is not left for the day the recipe runs on GPUs.
for check in "NUM_GPUS 1 a GPU count >= 1" "MAX_TOKENS_PER_GPU 0 a token count (0: one sample per micro-batch)"; do
   read -r var low what <<<"$check"; var=SLIME_SCRIPT_$var
   if [ -n "${!var:-}" ]; then  # empty: unset (the default)
      case "${!var}" in
         *[!0-9]*) bad=1 ;;
         *) bad=$(( 10#${!var} < low )) ;;
      esac
      if [ "$bad" = 1 ]; then echo "[geo3k] $var=${!var}: expected $what" >&2; exit 2; fi
      export "$var=$(( 10#${!var} ))"  # 08 -> 8: bash arithmetic reads a leading 0 as octal
   fi
done
USER_DIR=$PWD

# A path given relative to the directory the user ran the script from, made absolute.
abs_path() {
   case "$1" in
      /*|"") printf '%s' "$1" ;;
      *) local rel=${1#./}; printf '%s' "$USER_DIR${rel:+/$rel}" ;;
   esac
}
# A dataset (file, folder, FOLDER@split or hub name): made absolute when it names a local path
# there (with its @split kept), left as it is otherwise (a hub name).
abs_data() {
   if [ -z "$1" ] || [ "${1#/}" != "$1" ]; then printf '%s' "$1"
   elif [ -e "$USER_DIR/$1" ]; then abs_path "$1"
   elif [[ "$1" == *@* ]] && [ -e "$USER_DIR/${1%@*}" ]; then printf '%s@%s' "$(abs_path "${1%@*}")" "${1##*@}"
   else printf '%s' "$1"
   fi
}
for var in SLIME_SCRIPT_OUTPUT_DIR SLIME_SCRIPT_HF_CHECKPOINT; do
   if [ -n "${!var+x}" ]; then printf -v "$var" '%s' "$(abs_path "${!var}")"; fi
done
if [ -n "${SLIME_SCRIPT_DATASET_NAME+x}" ]; then SLIME_SCRIPT_DATASET_NAME=$(abs_data "$SLIME_SCRIPT_DATASET_NAME"); fi
# The same for the values of the path flags among the extra arguments (--flag VALUE and --flag=VALUE).
RESOLVED=()
PENDING=""  # the kind of value the previous argument asked for: path, data, or eval (NAME PATH pairs)
EVAL_INDEX=0
for arg in "$@"; do
   case "$PENDING" in
      path) RESOLVED+=("$(abs_path "$arg")"); PENDING=""; continue ;;
      data) RESOLVED+=("$(abs_data "$arg")"); PENDING=""; continue ;;
      eval)
         if [ "${arg#--}" = "$arg" ]; then
            if [ $((EVAL_INDEX % 2)) = 1 ]; then RESOLVED+=("$(abs_data "$arg")"); else RESOLVED+=("$arg"); fi
            EVAL_INDEX=$((EVAL_INDEX + 1)); continue
         fi
         PENDING="" ;;
   esac
   case "$arg" in
      --output-dir|--save|--load|--ref-load|--hf-checkpoint|--save-hf|--save-debug-rollout-data|--load-debug-rollout-data)
         PENDING=path ;;
      --prompt-data) PENDING=data ;;
      --eval-prompt-data) PENDING=eval; EVAL_INDEX=0 ;;
      --output-dir=*|--save=*|--load=*|--ref-load=*|--hf-checkpoint=*|--save-hf=*|--save-debug-rollout-data=*|--load-debug-rollout-data=*)
         RESOLVED+=("${arg%%=*}=$(abs_path "${arg#*=}")"); continue ;;
      --prompt-data=*) RESOLVED+=("--prompt-data=$(abs_data "${arg#*=}")"); continue ;;
   esac
   RESOLVED+=("$arg")
done
set -- ${RESOLVED[@]+"${RESOLVED[@]}"}
cd "$SLIME_DIR"
CHECK_ONLY=0  # --check-only among the extra arguments: the driver's check and nothing else (below)
for arg in "$@"; do [ "$arg" != "--check-only" ] || CHECK_ONLY=1; done

DATASET_NAME=${SLIME_SCRIPT_DATASET_NAME:-"chenhegu/geo3k_imgurl"}
NUM_GPUS=${SLIME_SCRIPT_NUM_GPUS:-8}
EXTERNAL_RAY=${SLIME_SCRIPT_EXTERNAL_RAY:-0}
MODEL_NAME=${SLIME_SCRIPT_MODEL_NAME:-"Qwen3.5-35B-A3B"}
HF_CHECKPOINT=${SLIME_SCRIPT_HF_CHECKPOINT:-"$HOME/models/$MODEL_NAME"}
TRAIN_BACKEND=${SLIME_SCRIPT_TRAIN_BACKEND:-"megatron"}
ROLLOUT_BACKEND=${SLIME_SCRIPT_ROLLOUT_BACKEND:-"sglang"}
OUTPUT_DIR=${SLIME_SCRIPT_OUTPUT_DIR:-""}
FORCE_CPU=${SLIME_SCRIPT_FORCE_CPU:-0}
SPECULATIVE=${SLIME_SCRIPT_SPECULATIVE:-off}
# Upstream's speculative decoding with the checkpoint's own MTP layer (slime.rollout.engines.sglang.config
# MTP_SPECULATIVE_FLAGS holds the same four flags for the benchmarks).
case "$SPECULATIVE" in
   off) SPECULATIVE_ARGS=() ;;
   mtp) SPECULATIVE_ARGS=(--sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps 2
                          --sglang-speculative-eagle-topk 1 --sglang-speculative-num-draft-tokens 3) ;;
   *) echo "[geo3k] SLIME_SCRIPT_SPECULATIVE=$SPECULATIVE: expected off or mtp" >&2; exit 2 ;;
esac
RECOMPUTE=${SLIME_SCRIPT_RECOMPUTE:-}  # empty: the backend's default (below)
case "$RECOMPUTE" in
   ""|full|selective|none) ;;
   *) echo "[geo3k] SLIME_SCRIPT_RECOMPUTE=$RECOMPUTE: expected full, selective or none" >&2; exit 2 ;;
esac
SKIP_ACTOR_FORWARD=${SLIME_SCRIPT_SKIP_ACTOR_FORWARD:-}  # empty: auto (the GPU recipe, below)
case "$SKIP_ACTOR_FORWARD" in
   ""|0|1) ;;
   *) echo "[geo3k] SLIME_SCRIPT_SKIP_ACTOR_FORWARD=$SKIP_ACTOR_FORWARD: expected 0, 1 or empty/unset (auto)" >&2; exit 2 ;;
esac
DRY_RUN=${SLIME_SCRIPT_DRY_RUN:-0}

# Set-up: create or reuse the virtualenv and install slime with its pins when missing.
# shellcheck disable=SC1091
source "$SLIME_DIR/scripts/setup_env.sh"
export PYTHONUNBUFFERED=1
# Never let NVLink multicast be used by NCCL / torch (it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}

lower() { echo "$1" | tr '[:upper:]' '[:lower:]'; }

# scripts/models/<name>.sh for a model name, compared without case (Qwen3.5-35B-A3B -> qwen3.5-35B-A3B.sh).
model_file() {
   local f
   for f in "$SLIME_DIR"/scripts/models/*.sh; do
      if [ "$(lower "$(basename "$f" .sh)")" = "$(lower "$1")" ]; then echo "$f"; return 0; fi
   done
   echo "[geo3k] no model file for SLIME_SCRIPT_MODEL_NAME=$1 in scripts/models/ ($(cd "$SLIME_DIR/scripts/models" && ls *.sh | tr '\n' ' ')); add one" >&2
   return 1
}

# Training data and the eval set for a dataset name, folder or file.
if [ -d "$DATASET_NAME" ]; then
   TRAIN_DATA="$DATASET_NAME"; EVAL_DATA="$DATASET_NAME/test.parquet"
   [ -e "$EVAL_DATA" ] || EVAL_DATA=""
elif [ -f "$DATASET_NAME" ]; then
   TRAIN_DATA="$DATASET_NAME"; EVAL_DATA=""
else
   TRAIN_DATA="$DATASET_NAME@train"; EVAL_DATA="$DATASET_NAME@test"
fi

arg_value() {  # the last value of flag $1 in the remaining arguments, or nothing
   local flag=$1 prev="" value="" arg; shift
   for arg in "$@"; do
      [ "$prev" = "$flag" ] && value=$arg
      case "$arg" in "$flag"=*) value=${arg#"$flag"=} ;; esac
      prev=$arg
   done
   printf '%s' "$value"
}
has_flag() {  # whether switch $1 is among the remaining arguments
   local flag=$1 arg; shift
   for arg in "$@"; do [ "$arg" != "$flag" ] || return 0; done
   return 1
}

GPUS_SEEN=0; GPU_GIB=0  # not asked when SLIME_SCRIPT_FORCE_CPU=1; the CUDA driver's answer, without importing torch
[ "$FORCE_CPU" = "1" ] || read -r GPUS_SEEN GPU_GIB < <(cd "$SLIME_DIR" && python -c \
   'from slime.utils.cuda_probe import main; main()' 2>/dev/null || echo 0 0)
GPUS_SEEN=${GPUS_SEEN:-0}; GPU_GIB=${GPU_GIB:-0}
NEED_DOWNLOAD=0
if [ "$GPUS_SEEN" = "0" ] || [ "$FORCE_CPU" = "1" ]; then
   # -------------------------------------------------------------------------------
   # Embedded default: no GPU here. Tiny Qwen3.5 + bundled geo3k sample, on CPU.
   # A variable set explicitly still applies (dataset, checkpoint, model file, ranks).
   # -------------------------------------------------------------------------------
   export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
   DEFAULT_OUTPUT_DIR=${OUTPUT_DIR:-"$SLIME_DIR/outputs/geo3k-tiny-cpu-$(date +%Y%m%d-%H%M%S)"}
   if [ -z "${SLIME_SCRIPT_DATASET_NAME+x}" ]; then
      TRAIN_DATA="$SLIME_DIR/examples/geo3k_vlm/data"; EVAL_DATA="$TRAIN_DATA/test.parquet"
   fi
   if [ -z "${SLIME_SCRIPT_HF_CHECKPOINT+x}" ]; then
      HF_CHECKPOINT=$(python scripts/tools/make_tiny_qwen35.py | tail -n 1)
      MODEL_SH="$SLIME_DIR/scripts/models/qwen3.5-tiny.sh"
   elif [ -n "${SLIME_SCRIPT_MODEL_NAME+x}" ]; then
      MODEL_SH=$(model_file "$MODEL_NAME")
   else
      MODEL_SH=""  # architecture from the checkpoint's config.json
   fi
   NUM_RANKS=${SLIME_SCRIPT_NUM_GPUS:-2}
   CPU_BACKEND=fsdp; CPU_TRAINER="FSDP2"
   if [ -n "${SLIME_SCRIPT_TRAIN_BACKEND+x}" ]; then   # set explicitly: megatron runs data-parallel on CPU too
      CPU_BACKEND=$TRAIN_BACKEND; CPU_TRAINER=$TRAIN_BACKEND
   fi
   CPU_ENGINE=transformers
   if [ -n "${SLIME_SCRIPT_ROLLOUT_BACKEND+x}" ]; then  # set explicitly: honoured (the driver says if it cannot run)
      CPU_ENGINE=$ROLLOUT_BACKEND
   fi
   [ "$CHECK_ONLY" = "1" ] || echo "[geo3k] no GPU found: running the embedded CPU default ($([ -z "${SLIME_SCRIPT_HF_CHECKPOINT+x}" ] && echo "tiny random Qwen3.5-MoE checkpoint" || echo "$HF_CHECKPOINT"), data $TRAIN_DATA, $CPU_ENGINE engine, $NUM_RANKS $CPU_TRAINER trainer ranks over gloo)."
   ROLLOUT_ARGS=(--num-rollout 10 --rollout-batch-size 4 --n-samples-per-prompt 4
                 --rollout-max-response-len 32 --rollout-temperature 1.0 --global-batch-size 8)
   EVAL_SETTINGS=(--eval-interval 5 --eval-max-response-len 32)
   BACKEND_ARGS=(--train-backend "$CPU_BACKEND" --micro-batch-size 1)
   ROLLOUT_ENGINE_ARGS=(--rollout-backend "$CPU_ENGINE" --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1)
   MISC_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node "$NUM_RANKS" --save-interval 3)
   BACKEND_NAME=$CPU_BACKEND
else
   # -------------------------------------------------------------------------------
   # Full recipe on a GPU node (upstream structure).
   # -------------------------------------------------------------------------------
   DEFAULT_OUTPUT_DIR=${OUTPUT_DIR:-"$SLIME_DIR/outputs/geo3k-$(lower "$MODEL_NAME")-$(date +%Y%m%d-%H%M%S)"}
   MODEL_SH=$(model_file "$MODEL_NAME")
   [ -d "$HF_CHECKPOINT" ] || NEED_DOWNLOAD=1
   ROLLOUT_ARGS=(--num-rollout 3000 --rollout-batch-size 64 --n-samples-per-prompt 8
                 --rollout-max-response-len 4096 --rollout-temperature 0.8 --global-batch-size 512)
   EVAL_SETTINGS=(--eval-interval 20 --eval-max-response-len 4096)
   BACKEND_ARGS=(--train-backend "$TRAIN_BACKEND" --micro-batch-size 1 --bf16)
   if [ "$TRAIN_BACKEND" = "megatron" ]; then
      # Upstream's TP 2 with sequence parallelism; one GPU runs TP 1 (then without it).
      if [ "$NUM_GPUS" -ge 2 ]; then TP_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel)
      else TP_ARGS=(--tensor-model-parallel-size 1); fi
      # Packed micro-batches (fla's varlen Gated DeltaNet, proven equal to one sample at a time at TP = PP =
      # CP = EP = 1) instead of upstream's one sample per micro-batch: at 128 samples a step, one micro-batch
      # each spends the train phase in per-micro-batch overhead (docs/results/h200_train_phase.md).  Half as many
      # tokens on a card under 120 GiB (an 80 GB H100): the 3.2 B-parameter scaled model's weights, fp32 gradients,
      # main weights and Adam moments alone take 54 GiB there.
      DEFAULT_TOKENS=$([ "$GPU_GIB" -ge 120 ] && echo 8192 || echo 4096)
      MAX_TOKENS=${SLIME_SCRIPT_MAX_TOKENS_PER_GPU:-$([ "$NUM_GPUS" = 1 ] && echo "$DEFAULT_TOKENS" || echo 0)}
      [ "$MAX_TOKENS" = 0 ] || BACKEND_ARGS+=(--use-dynamic-batch-size --max-tokens-per-gpu "$MAX_TOKENS")
      # Upstream's full recompute, unless SLIME_SCRIPT_RECOMPUTE or the extra arguments choose (then theirs alone)
      # or the run asks for R3, whose replayed routes reach the forward passes but not a backward's recompute:
      # selective there.
      if [ -n "$RECOMPUTE" ] && [ -n "$(arg_value --recompute-granularity "$@")" ]; then
         echo "[geo3k] SLIME_SCRIPT_RECOMPUTE=$RECOMPUTE and --recompute-granularity $(arg_value --recompute-granularity "$@") both choose the recomputation: set one" >&2
         exit 2
      fi
      if [ -z "$RECOMPUTE" ]; then
         RECOMPUTE=full; has_flag --use-rollout-routing-replay "$@" && RECOMPUTE=selective
      fi
      case "$RECOMPUTE" in
         full) RECOMPUTE_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
         selective) RECOMPUTE_ARGS=(--recompute-granularity selective) ;;
         none) RECOMPUTE_ARGS=() ;;
      esac
      [ -z "$(arg_value --recompute-granularity "$@")" ] || RECOMPUTE_ARGS=()
      BACKEND_ARGS+=(
         "${TP_ARGS[@]}"
         --pipeline-model-parallel-size 1 --context-parallel-size 1
         --expert-model-parallel-size "$NUM_GPUS" --expert-tensor-parallel-size 1
         "${RECOMPUTE_ARGS[@]}"
         --attention-dropout 0.0 --hidden-dropout 0.0
         --accumulate-allreduce-grads-in-fp32 --attention-backend flash
      )  # upstream's --attention-softmax-in-fp32 is refused here: no kernel reads it (docs/design/model_args.md)
   else
      case "${RECOMPUTE:-full}" in
         full) BACKEND_ARGS+=(--gradient-checkpointing) ;;
         none) ;;
         *) echo "[geo3k] SLIME_SCRIPT_RECOMPUTE=$RECOMPUTE: the fsdp trainer recomputes full layers or none" >&2; exit 2 ;;
      esac
   fi
   # SLIME_SCRIPT_SKIP_ACTOR_FORWARD empty: no old-log-prob pass (--skip-actor-forward-only: the training forward's
   # log-probs, detached, are the old ones) where a rollout step is one optimizer step and no extra argument needs
   # the pass; the batch sizes are the recipe's unless the extra arguments set them.
   if [ -z "$SKIP_ACTOR_FORWARD" ] && ! has_flag --skip-actor-forward-only "$@"; then
      PROMPTS=$(arg_value --rollout-batch-size "${ROLLOUT_ARGS[@]}" "$@")
      SAMPLES=$(arg_value --n-samples-per-prompt "${ROLLOUT_ARGS[@]}" "$@")
      BATCH=$(arg_value --global-batch-size "${ROLLOUT_ARGS[@]}" "$@")
      KL_COEF=$(arg_value --kl-coef "$@")
      KEEP_PASS=""  # why the pass stays
      if has_flag --use-rollout-logprobs "$@"; then
         KEEP_PASS="--use-rollout-logprobs takes the old log-probs from the rollout"
      elif has_flag --use-routing-replay "$@" && ! has_flag --use-rollout-routing-replay "$@"; then
         KEEP_PASS="--use-routing-replay without --use-rollout-routing-replay replays the routes the pass records"
      elif has_flag --debug-rollout-only "$@"; then
         KEEP_PASS="--debug-rollout-only runs no training step"
      elif ! [[ $PROMPTS =~ ^[0-9]+$ && $SAMPLES =~ ^[0-9]+$ && $BATCH =~ ^[0-9]+$ ]] \
           || (( 10#$BATCH != 10#$PROMPTS * 10#$SAMPLES )); then
         KEEP_PASS="--global-batch-size $BATCH is not --rollout-batch-size $PROMPTS x --n-samples-per-prompt $SAMPLES: a rollout step is not one optimizer step"
      elif has_flag --normalize-advantages "$@" && ! [[ $KL_COEF =~ ^[+-]?0*\.?0*([eE][+-]?[0-9]+)?$ ]]; then
         KEEP_PASS="--kl-coef $KL_COEF with --normalize-advantages whitens with the old log-probs before the training forward"
      fi
      SKIP_ACTOR_FORWARD=1
      if [ -n "$KEEP_PASS" ]; then
         SKIP_ACTOR_FORWARD=0
         [ "$CHECK_ONLY" = "1" ] || echo "[geo3k] the old-log-prob pass stays (no --skip-actor-forward-only): $KEEP_PASS."
      fi
   fi
   if [ "$ROLLOUT_BACKEND" = "sglang" ]; then
      GPUS_PER_ENGINE=$(( NUM_GPUS < 8 ? NUM_GPUS : 8 ))
      # Upstream's 0.7 of the card for SGLang's static pools; 0.6 with the MTP draft on a card under 120 GiB, where
      # 0.7 left 23 GB and the server died at start-up (cuMemCreate out of memory, an 80 GB H100 with the scaled
      # model: docs/results/h200_train_phase.md, the seventh run).  --sglang-mem-fraction-static among the extra
      # arguments chooses instead (the last one wins).
      MEM_FRACTION=$([ "$SPECULATIVE" = mtp ] && [ "$GPU_GIB" -lt 120 ] && echo 0.6 || echo 0.7)
      ROLLOUT_ENGINE_ARGS=(--rollout-backend sglang --rollout-num-gpus-per-engine "$GPUS_PER_ENGINE"
                           --sglang-mem-fraction-static "$MEM_FRACTION" --sglang-ep-size "$GPUS_PER_ENGINE"
                           --sglang-max-running-requests 512 --sglang-disable-custom-all-reduce)
   else
      ROLLOUT_ENGINE_ARGS=(--rollout-backend "$ROLLOUT_BACKEND" --rollout-num-gpus-per-engine 1)
   fi
   MISC_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node "$NUM_GPUS" --colocate --save-interval 100)
   BACKEND_NAME=$TRAIN_BACKEND
fi
# SLIME_SCRIPT_SKIP_ACTOR_FORWARD 1 (or auto's choice on a GPU, above): the flag, unless the extra arguments have it;
# on the CPU default too (its 4 x 4 samples are two optimizer steps of 8, so the driver refuses it, naming why)
if [ "$SKIP_ACTOR_FORWARD" = "1" ] && ! has_flag --skip-actor-forward-only "$@"; then
   BACKEND_ARGS+=(--skip-actor-forward-only)
fi

# Extra arguments override the script's (argparse keeps the last value), with three that need
# help: --num-epoch excludes the script's --num-rollout, --output-dir moves the run (metrics, plot,
# command.sh, default checkpoints) and --save the checkpoints.
OUTPUT_DIR=$(arg_value --output-dir "$@"); OUTPUT_DIR=${OUTPUT_DIR:-$DEFAULT_OUTPUT_DIR}
SAVE_DIR=$(arg_value --save "$@"); SAVE_DIR=${SAVE_DIR:-$OUTPUT_DIR/checkpoints}
if [ -n "$(arg_value --num-epoch "$@")" ] && [ "${ROLLOUT_ARGS[0]}" = "--num-rollout" ]; then
   ROLLOUT_ARGS=("${ROLLOUT_ARGS[@]:2}")
fi

MODEL_ARGS=()
if [ -n "$MODEL_SH" ]; then
   # shellcheck disable=SC1090
   source "$MODEL_SH"
fi
EVAL_ARGS=()
if [ -n "$EVAL_DATA" ]; then
   EVAL_ARGS=(--eval-prompt-data geo3k "$EVAL_DATA" --n-samples-per-eval-prompt 1 "${EVAL_SETTINGS[@]}")
fi
WANDB_ARGS=()
if [ -n "${WANDB_API_KEY:-}" ]; then
   # The key stays in the environment (wandb reads WANDB_API_KEY): never on the command line,
   # where ps and command.sh would show it.
   WANDB_ARGS=(--use-wandb --wandb-project slime-geo3k-vlm --wandb-group "$(lower "$MODEL_NAME")-$BACKEND_NAME"
               --disable-wandb-random-suffix)
fi
# Upstream's estimator of the KL loss, passed only when the extra arguments turn that loss on: without it the flag
# does nothing (and the trainer warns so).
KL_TYPE_ARGS=()
if has_flag --use-kl-loss "$@"; then KL_TYPE_ARGS=(--kl-loss-type low_var_kl); fi
ARGS=(
   "${MODEL_ARGS[@]}"
   --hf-checkpoint "$HF_CHECKPOINT"
   --save "$SAVE_DIR"
   --prompt-data "$TRAIN_DATA"
   --input-key problem --label-key answer --multimodal-keys '{"image": "images"}'
   --apply-chat-template --rollout-shuffle
   --rm-type math
   "${ROLLOUT_ARGS[@]}"
   "${EVAL_ARGS[@]}"
   --advantage-estimator grpo --kl-loss-coef 0.00 ${KL_TYPE_ARGS[@]+"${KL_TYPE_ARGS[@]}"} --kl-coef 0.00
   --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
   --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
   "${ROLLOUT_ENGINE_ARGS[@]}"
   ${SPECULATIVE_ARGS[@]+"${SPECULATIVE_ARGS[@]}"}
   "${WANDB_ARGS[@]}"
   "${BACKEND_ARGS[@]}"
   "${MISC_ARGS[@]}"
   --output-dir "$OUTPUT_DIR"
)
if [ "$EXTERNAL_RAY" = "1" ]; then
   ARGS+=(--ray-address "${RAY_ADDRESS:-auto}")
fi

if [ "$DRY_RUN" = "1" ]; then
   printf '%q ' python -m slime.train "${ARGS[@]}" "$@"; echo
   exit 0
fi
if [ "$CHECK_ONLY" = "1" ]; then
   # Only the check: it reads no data or checkpoint and claims no folder, so no folder probe, no
   # download, no run and nothing to resume; its result ("slime: flags OK ..." or the error) is all.
   exec python -m slime.train "${ARGS[@]}" "$@"
fi
# Refuse, before downloading or starting anything, a run directory or checkpoint folder that a live
# run holds, or that holds a run's results this one neither resumes nor overwrites.  The driver
# checks again when it takes the folders' locks (two launchers may pass this probe at once), and
# only then writes command.sh into the run directory.
python -m slime.utils.run_lock "${ARGS[@]}" "$@" || exit $?
if [ "$NEED_DOWNLOAD" = "1" ]; then
   # Refuse bad flags or a backend missing here before a download of tens of GB.
   python -m slime.train "${ARGS[@]}" "$@" --check-only >/dev/null || exit $?
   echo "[geo3k] downloading Qwen/$MODEL_NAME to $HF_CHECKPOINT"
   hf download "Qwen/$MODEL_NAME" --local-dir "$HF_CHECKPOINT"
fi

# The command that resumes this run into the same folders: the SLIME_SCRIPT_* variables that were
# set (but OUTPUT_DIR, given resolved, and DRY_RUN), this script, the extra arguments as given (so a custom --save or --output-dir stays) minus
# --load, --overwrite-output-dir and flag $1 (when not empty: the one the caller appends), then
# --load of the checkpoint folder.
resume_command() {
   local words=("SLIME_SCRIPT_OUTPUT_DIR=$OUTPUT_DIR") var skip=0 arg drop=$1
   shift
   for var in "${KNOWN_VARS[@]/#/SLIME_SCRIPT_}"; do
      case "$var" in SLIME_SCRIPT_OUTPUT_DIR|SLIME_SCRIPT_DRY_RUN) continue ;; esac
      if [ -n "${!var+x}" ]; then words+=("$var=${!var}"); fi
   done
   words+=(bash "$SLIME_DIR/examples/geo3k_vlm/run_geo3k_qwen35.sh")
   for arg in "$@"; do
      if [ "$skip" = "1" ]; then skip=0; continue; fi
      case "$arg" in
         --load) skip=1 ;;
         --load=*|--overwrite-output-dir|--no-overwrite-output-dir) ;;
         *)
            if [ -n "$drop" ] && [ "$arg" = "$drop" ]; then skip=1
            elif [ -n "$drop" ] && [ "${arg#"$drop"=}" != "$arg" ]; then :
            else words+=("$arg"); fi ;;
      esac
   done
   words+=(--load "$SAVE_DIR")
   printf '%q ' "${words[@]}"
}
# Printed only once the run has started (never before the driver validated the flags): when it
# stops after its first rollout step began, and at the end (to extend it, without the user's own
# value of the flag it sets again).
RESUME=$(resume_command "" "$@")
EXTEND_FLAG=--num-rollout
if [ -n "$(arg_value --num-epoch "$@")" ]; then EXTEND_FLAG=--num-epoch; fi
EXTEND=$(resume_command "$EXTEND_FLAG" "$@")

# Run the driver in its own session and, on any exit or signal, stop only that session: the
# driver, the Ray instance it started and its actors, then wait until they are gone. The
# session, not the driver's process group: Ray gives every worker a process group of its own.
# Only processes started by the driver are in the session, so nothing else on the machine is
# touched (unlike the upstream script: no pkill of ray/sglang/redis by name).  A signal that
# cannot be trapped (SIGKILL of this script) is covered by --parent-pid: the driver watches this
# script's PID and stops the run within seconds of its death (not in command.sh, which reruns).
setsid python -m slime.train "${ARGS[@]}" "$@" --parent-pid $$ &
DRIVER_PID=$!
run_pids() {  # live processes of the driver's session, read from /proc (zombies have exited)
   local stat line fields
   for stat in /proc/[0-9]*/stat; do
      read -r line 2>/dev/null <"$stat" || continue
      read -r -a fields <<<"${line##*) }"  # after "pid (comm) ": state ppid pgrp session ...
      if [ "${fields[3]:-}" = "$DRIVER_PID" ] && [ "${fields[0]:-}" != "Z" ]; then
         stat=${stat#/proc/}; echo "${stat%/stat}"
      fi
   done
}
driver_runs() {  # whether the driver itself still runs (not a zombie; the same process: its session's leader)
   local line fields
   read -r line 2>/dev/null <"/proc/$DRIVER_PID/stat" || return 1
   read -r -a fields <<<"${line##*) }"
   [ "${fields[0]:-}" != "Z" ] && [ "${fields[3]:-}" = "$DRIVER_PID" ]
}
stop_run() {
   # The driver first, alone: on SIGTERM it stops its engines, its trainers and the Ray instance it started while
   # they still answer (signalled at once with the driver, Ray's own processes died first and left its clean-up
   # waiting on them until the SIGKILL below).  Then whatever of the session is left: SIGTERM, then SIGKILL.
   local sig pids
   if driver_runs; then
      kill -TERM "$DRIVER_PID" 2>/dev/null || true
      for _ in $(seq 1 100); do driver_runs || break; sleep 0.2; done
   fi
   for sig in TERM KILL; do
      pids=$(run_pids); [ -n "$pids" ] || return 0
      # shellcheck disable=SC2086
      kill "-$sig" $pids 2>/dev/null || true
      for _ in $(seq 1 20); do [ -n "$(run_pids)" ] || return 0; sleep 0.5; done
   done
}
cleanup() {
   local status=$?
   stop_run
   case "$status" in
      0) ;;
      # The driver's status for an error before its first rollout step (slime/train.py): bad flags
      # or data, a folder another run holds or that holds a run: nothing of this run to resume.
      2) echo "[geo3k] the run did not start (exit 2; the error is above): nothing to resume. Fix it and run" \
              "the same command again" ;;
      *) echo "[geo3k] the run stopped (exit $status); resume it with: $RESUME" ;;
   esac
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
STATUS=0
wait "$DRIVER_PID" || STATUS=$?
if [ "$STATUS" = "0" ]; then
   echo "[geo3k] done. Output: $OUTPUT_DIR"
   echo "[geo3k]   metrics:      $OUTPUT_DIR/metrics.jsonl"
   echo "[geo3k]   reward curve: $OUTPUT_DIR/reward_curve.png"
   echo "[geo3k]   checkpoints:  $SAVE_DIR"
   echo "[geo3k] resume or extend (same metrics file): $EXTEND$EXTEND_FLAG N"
fi
exit "$STATUS"
