# Qwen3.5-35B-A3B cut to one GPU for the GPU acceptance runs: the released widths (hidden 2048, heads,
# Gated DeltaNet heads, expert and shared-expert width 512, top-8, vocab 248,320, the vision tower),
# 4 layers (3 Gated DeltaNet + 1 gated attention) and 128 experts.  The checkpoint is built by
# `python scripts/tools/make_scaled_qwen35.py DIR` (slime/checkpoints/scaled_qwen35.py: random bf16 weights,
# 3.22 B parameters, and one MTP layer of 0.44 B that only SGLang's speculative decoding reads, unless --no-mtp);
# use it with SLIME_SCRIPT_MODEL_NAME=Qwen3.5-35B-A3B-scaled SLIME_SCRIPT_HF_CHECKPOINT=DIR.

source "$(dirname -- "${BASH_SOURCE[0]}")/qwen3.5-35B-A3B.sh"

MODEL_ARGS+=(
   --num-layers 4
   --num-experts 128
   --max-position-embeddings 8192
)
