"""slime: RL post-training (GRPO) for vision-language models.

Package map (one concept per module):

- ``slime.train``: the driver loop (generate -> reward -> advantages -> train -> sync -> eval -> save).
- ``slime.utils``: flags (``arguments``), data (``data``), GRPO math (``ppo_utils``), sample type (``types``).
- ``slime.rollout``: rollout manager, rollout engines, reward functions (``rm_hub``).
- ``slime.backends``: training backends behind one trainer interface (``fsdp``, ``megatron``).
- ``slime.ray``: placement groups and actor groups (the only orchestrator is Ray).
- ``slime.models``: model builders (the tiny Qwen3.5 checkpoint) and weight mappings.
"""

__version__ = "0.1.0"
