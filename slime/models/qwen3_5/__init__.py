"""The native Megatron Qwen3.5-MoE model: megatron-core specs, this package's layers and the HF vision tower.

Only :mod:`.config`, :mod:`.packing`, :mod:`.rope` and :mod:`.vision` import without megatron-core; the
mapping to Hugging Face checkpoints is ``docs/design/qwen35_native.md``.
"""
