"""The native Megatron Qwen3.5-MoE model (megatron-core specs + this package's layers + the HF vision tower).

One module per concept:

- :mod:`.config`: HF ``config.json`` -> :class:`Qwen35Arch`, megatron-core ``TransformerConfig``, kernels;
- :mod:`.packing`: packed (THD) documents, ``cu_seqlens`` and index maps;
- :mod:`.rope`: MRoPE positions of packed samples and the interleaved partial rotary;
- :mod:`.norm`: the zero-centred and the gated RMSNorm;
- :mod:`.gdn`: Gated DeltaNet (fla kernels or a torch path), sharded by heads;
- :mod:`.attention`: gated full attention over packed documents (``varlen_attn`` or SDPA);
- :mod:`.experts`: routed experts as grouped GEMMs (``torch._grouped_mm``);
- :mod:`.vision`: the HF vision tower and the image-feature scatter;
- :mod:`.spec`: the megatron-core ``ModuleSpec``s;
- :mod:`.model`: :class:`Qwen35Model` and its inputs;
- :mod:`.weights`: HF checkpoint <-> native parameters (per-rank load, per-rank export).

Only :mod:`.config`, :mod:`.packing`, :mod:`.rope` and :mod:`.vision` import without megatron-core.
"""
