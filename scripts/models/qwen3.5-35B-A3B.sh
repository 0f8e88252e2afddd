# Qwen3.5-35B-A3B language model as slime / Megatron flags (source this file, then pass "${MODEL_ARGS[@]}").
# The numbers are those of the released checkpoint (Qwen/Qwen3.5-35B-A3B config.json, text_config);
# tests/test_model_args.py checks them against transformers' Qwen3_5MoeConfig() defaults.
# The vision tower is not configured here: it is loaded from the HF checkpoint as is.

# Flags shared by every Qwen3.5-MoE size (scripts/models/qwen3.5-tiny.sh reuses them).
QWEN35_MOE_ARCH_ARGS=(
   --disable-bias-linear
   --qk-layernorm
   --attention-output-gate                # full-attention layers gate their output with sigmoid(q_proj gate half)
   --normalization RMSNorm
   --apply-layernorm-1p                   # zero-centred RMSNorm gamma: x * (1 + w)
   --norm-epsilon 1e-6
   --swiglu
   --untie-embeddings-and-output-weights
   --position-embedding-type rope
   --group-query-attention
   --moe-layer-freq 1                     # every layer is MoE
   --moe-router-score-function softmax
   --moe-aux-loss-coeff 0
   --moe-shared-expert-gate               # sigmoid gate on the shared expert's output
   --linear-attention-freq 4              # layers 4, 8, ... are full attention; the others Gated DeltaNet
)

MODEL_ARGS=(
   "${QWEN35_MOE_ARCH_ARGS[@]}"
   --num-layers 40
   --hidden-size 2048
   --ffn-hidden-size 512                  # unused (no dense MLP layer); set to the expert size
   --num-attention-heads 16
   --num-query-groups 2
   --kv-channels 256
   --rotary-percent 0.25
   --rotary-base 10000000                 # released checkpoint; transformers' default rope_theta is 1e4
   --max-position-embeddings 262144
   --vocab-size 248320
   --num-experts 256
   --moe-router-topk 8
   --moe-ffn-hidden-size 512
   --moe-shared-expert-intermediate-size 512
   --linear-conv-kernel-dim 4
   --linear-key-head-dim 128
   --linear-value-head-dim 128
   --linear-num-key-heads 16
   --linear-num-value-heads 32
)
