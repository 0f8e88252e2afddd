"""slime: RL post-training (GRPO) for vision-language models.

Packages in pipeline order (docs/design/layout.md):

- ``slime.data``: dataset rows -> prompt samples (sources, dataset, image, processor), the ``Sample`` record.
- ``slime.rollout``: rollout manager, engines, the request scheduler, rewards (``rm_hub``), sampling seeds,
  the engine parity check.
- ``slime.grpo``: advantages, log-probs from logits, the policy loss every backend calls.
- ``slime.backends``: training backends behind one trainer interface (``fsdp``, ``megatron``).
- ``slime.weight_sync``: weights from the trainer ranks to the engines, one transport per run.
- ``slime.ray``: Ray start-up, placement groups, colocation, the trainer group and the engine group.
- ``slime.checkpoints``: checkpoint layout, the Hugging Face folder (``config.json``), MODEL_ARGS against a
  checkpoint, the tiny test checkpoint.
- ``slime.errors``: ``SlimeError``, the base of every error reported to the user as a message.
- ``slime.models``: model code only (the native Megatron Qwen3.5 model, ``qwen3_5``).
- ``slime.arguments``: the parser, the only module that imports every package's flag group (``config.py``).
- ``slime.train`` (the command line) and ``slime.driver`` (the rollout-step loop) on top.
- ``slime.utils``: generic helpers (flag machinery, registries, timer, run locks, lifetime, env check, metrics).
"""

__version__ = "0.1.0"
