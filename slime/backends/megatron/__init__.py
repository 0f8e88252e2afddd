"""``--train-backend megatron``: slime's native Megatron-core Qwen3.5 model (Gated DeltaNet, gated attention, MoE) with
the Hugging Face vision tower, trained with GRPO.  :mod:`.backend` is the registry's target; :mod:`.config` (flags,
checks, checkpoint layout) imports no megatron-core.
"""
