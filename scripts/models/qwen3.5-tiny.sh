# The tiny random Qwen3.5-MoE test model (slime/checkpoints/tiny_qwen35.py, default options: BPE
# tokenizer of 2048 ids) as slime / Megatron flags.  Same architecture flags as
# Qwen3.5-35B-A3B; tests/test_model_args.py checks the numbers against the built config.json.
# A word-level tiny checkpoint (vocab_words=...) has a smaller vocab: override --vocab-size.

source "$(dirname -- "${BASH_SOURCE[0]}")/qwen3.5-35B-A3B.sh"

MODEL_ARGS=(
   "${QWEN35_MOE_ARCH_ARGS[@]}"
   --num-layers 4
   --hidden-size 64
   --ffn-hidden-size 32                   # unused (no dense MLP layer); set to the expert size
   --num-attention-heads 4
   --num-query-groups 2
   --kv-channels 32
   --rotary-percent 0.25
   --rotary-base 10000000
   --max-position-embeddings 8192
   --vocab-size 2048
   --num-experts 8
   --moe-router-topk 2
   --moe-ffn-hidden-size 32
   --moe-shared-expert-intermediate-size 32
   --linear-conv-kernel-dim 4
   --linear-key-head-dim 16
   --linear-value-head-dim 16
   --linear-num-key-heads 2
   --linear-num-value-heads 4
)
