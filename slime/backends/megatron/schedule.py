"""Running micro-batches through megatron-core's forward-backward schedule.

On CUDA this is megatron-core's own ``get_forward_backward_func()`` (no pipelining, or 1F1B across
``--pipeline-model-parallel-size`` stages with variable-length packed micro-batches), which ends with
``config.finalize_model_grads_func`` (megatron-core's ``finalize_model_grads``: the data-parallel
gradient reduction, and the TP all-reduce of the sequence-parallel and q/k-norm gradients).

On CPU megatron-core's schedules cannot run: ``forward_backward_no_pipelining`` allocates its token
counter with ``device="cuda"`` and the pipelined ones communicate through CUDA streams.  Without
pipelining that schedule is a loop over micro-batches of megatron-core's own ``forward_step`` (which
calls the loss function, scales the loss and collects its metrics) and ``backward_step``, then
``finalize_model_grads``; :func:`run_micro_batches` runs exactly that loop on CPU, so the CPU tests
exercise the same loss contract and gradient finalisation as the GPU schedule.
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
    """Forward (and backward) every micro-batch of one optimizer step (or of a no-grad pass).

    Args:
        model: the stage's model as the schedule sees it (megatron-core's DDP wrapper, its CPU stand-in,
            or the bare model for forward-only passes of a reference model).
        batches: the micro-batches, in order (every data-parallel rank runs the same number).
        forward_step_func: from :func:`slime.backends.megatron.loss.make_forward_step`.
        forward_only: no backward pass and no gradient finalisation.
        device: the training device (CUDA: megatron-core's schedule; CPU: the loop of the module docstring).

    Returns:
        The loss functions' metrics dicts, one per micro-batch, on the last pipeline stage (empty elsewhere).
    """
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
