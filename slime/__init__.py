"""slime: RL post-training (GRPO) for vision-language models.

Package map (one concept per module):

- ``slime.train``: the driver loop (generate -> reward -> advantages -> train -> sync -> eval -> save).
- ``slime.utils``: flags (``arguments``, ``config``), registries (``registry``), data (``data``), GRPO math
  (``ppo_utils``), sample type (``types``).
- ``slime.rollout``: rollout manager, rollout engines, reward functions (``rm_hub``).
- ``slime.backends``: training backends behind one trainer interface (``fsdp``, ``megatron``).
- ``slime.weight_sync``: weight sync from the trainer ranks to the engines, one transport per run
  (``object_store`` now; CUDA IPC and NCCL hooks documented in ``weight_sync.base``).
- ``slime.ray``: placement groups and actor groups (the only orchestrator is Ray).
- ``slime.models``: model builders (the tiny Qwen3.5 checkpoint), MODEL_ARGS against a checkpoint's
  config (``qwen35_args``), and the native Megatron Qwen3.5 model (``qwen3_5``: config, specs, layers,
  HF weight load / export).
"""

__version__ = "0.1.0"
