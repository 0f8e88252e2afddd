"""``--train-backend megatron``: slime's native Megatron-core Qwen3.5 language model (Gated DeltaNet +
gated attention + MoE) with the Hugging Face vision tower, trained with GRPO.

- :mod:`.config`: flags, parse-time checks, data-parallel size, checkpoint layout (importable without
  megatron-core; the parser builds it for every run);
- :mod:`.backend`: :class:`~slime.backends.megatron.backend.MegatronBackend`, the registry's target;
- :mod:`.parallel`: the trainer world and megatron-core's parallel state;
- :mod:`.model`: this rank's pipeline stage, loaded from a Hugging Face folder;
- :mod:`.batches`: samples -> packed THD micro-batches and the loss tensors;
- :mod:`.loss`: megatron-core forward-step / loss functions around the shared GRPO loss;
- :mod:`.schedule`: megatron-core's forward-backward schedule (its CPU loop);
- :mod:`.optimizer`: DDP + distributed AdamW (GPU), the CPU stand-in;
- :mod:`.checkpoint`: the Hugging Face-named ``torch.distributed.checkpoint``, ``--save-hf``;
- :mod:`.weight_export`: lockstep weight buckets for the weight sync.
"""
