"""Ray orchestration: placement groups, colocation of trainers and rollout engines, actor groups.

``slime.ray.config`` holds the cluster flags (MISC_ARGS).
"""
