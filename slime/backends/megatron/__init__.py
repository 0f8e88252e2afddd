"""``--train-backend megatron``: slime's native Megatron-core Qwen3.5 language model (Gated DeltaNet +
gated attention + MoE) with the Hugging Face vision tower; not in this version yet.

What exists already is its light side, :mod:`slime.backends.megatron.config` (flags, checks,
data-parallel size, checkpoint layout), importable without megatron-core.  The backend class goes
next to it and is named as the ``target`` of ``"megatron"`` in
:data:`slime.backends.registry.TRAIN_BACKENDS`.
"""
