"""Training backends behind one trainer interface (``fsdp``; ``megatron`` declared, next).

``slime.backends.config`` holds the flags every backend reads (BACKEND_ARGS, OPTIMIZER_ARGS,
CKPT_ARGS, MODEL_ARGS) and :class:`~slime.backends.config.BackendConfig`; each backend's own
flags and checks are in ``slime/backends/<name>/config.py``; ``slime.backends.registry`` maps
``--train-backend`` names to both.
"""
