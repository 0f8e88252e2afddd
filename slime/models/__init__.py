"""Model definitions and helpers: the tiny Qwen3.5-MoE test checkpoint (``tiny_qwen35``)."""
