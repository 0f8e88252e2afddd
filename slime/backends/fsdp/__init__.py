"""``--train-backend fsdp``: the Hugging Face model under torch FSDP2 (see :mod:`slime.backends.fsdp.backend`)."""
