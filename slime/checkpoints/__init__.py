"""Checkpoints: where a run's checkpoint parts live, the MODEL_ARGS check against a Hugging Face
checkpoint, and the tiny test checkpoint.

- :mod:`.layout`: the ``--save`` / ``--load`` folder layout (iterations, the latest marker, completeness);
- :mod:`.hf`: a Hugging Face model folder: the one ``config.json`` reader and the one folder check;
- :mod:`.model_args`: MODEL_ARGS flags against the ``--hf-checkpoint``'s ``config.json`` and model (parse time);
- :mod:`.mtp`: Qwen3.5's multi-token-prediction layer (its tensors, a random one, whether a checkpoint has one);
- :mod:`.tiny_qwen35`: the tiny (and scaled) random Qwen3.5-MoE checkpoint builder for tests and benchmarks.
"""
