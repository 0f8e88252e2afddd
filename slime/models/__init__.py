"""Model code: the native Megatron-core Qwen3.5 model (:mod:`.qwen3_5`: config, specs, layers, HF weight load / export)."""
