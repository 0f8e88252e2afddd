"""Training backends behind one trainer interface (``fsdp``, ``megatron``).

``slime.backends.config`` holds their flags: BACKEND_ARGS, OPTIMIZER_ARGS, CKPT_ARGS and MODEL_ARGS.
"""
