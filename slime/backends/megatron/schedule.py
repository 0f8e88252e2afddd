"""Running micro-batches through megatron-core's forward-backward schedule: ``get_forward_backward_func()`` on CUDA (no
pipelining, or 1F1B over pipeline stages), ending with ``finalize_model_grads``; on CPU, where its schedules cannot
run, the same loop of its ``forward_step`` / ``backward_step`` and ``finalize_model_grads``
(``docs/design/training_step.md``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from slime.backends.megatron.batches import PackedBatch


def run_micro_batches(
    model: torch.nn.Module,
    batches: Sequence[PackedBatch],
    forward_step_func: Callable,
    *,
    forward_only: bool,
    device: torch.device,
) -> list[dict]:
    """Forward (and unless ``forward_only``, backward and gradient finalisation) every micro-batch of one optimizer
    step, in order (the same count on every DP rank).  ``model`` as the schedule sees it (DDP wrapper, CPU stand-in, or
    the bare model for forward-only passes); ``forward_step_func`` from :func:`.loss.make_forward_step`.  Returns the
    loss functions' metrics, one dict per micro-batch, on the last pipeline stage (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if device.type == "cuda":
        forward_backward = get_forward_backward_func()
        return forward_backward(
            forward_step_func=forward_step_func, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=max(b.num_tokens for b in batches), micro_batch_size=1,
            forward_only=forward_only,
        )
    return _cpu_no_pipelining(model, batches, forward_step_func, forward_only=forward_only)


def _cpu_no_pipelining(model, batches, forward_step_func, *, forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.utils import get_model_config, get_model_type

    config = get_model_config(model)
    model_type = get_model_type(model)
    store: list[dict] = []
    iterator = iter(batches)
    for i in range(len(batches)):
        output, _ = forward_step(forward_step_func, iterator, model, len(batches), None, store, config,
                                 cp_group_size=1, is_first_microbatch=i == 0, current_microbatch=i)
        if not forward_only:
            backward_step(None, output, None, model_type, config)
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], None)
    return store
