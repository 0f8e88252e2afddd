"""``--train-backend fsdp``'s own flags (BACKEND_ARGS (fsdp)), checks, data-parallel size and checkpoint layout.

Importable without the backend's module :mod:`slime.backends.fsdp.backend` (no model code, no
FSDP wrapping, no process group, no torch). The parser builds :class:`FSDPConfig`
for every run, and :func:`slime.arguments.validate` runs its hooks when ``--train-backend
fsdp`` is selected.

The FSDP backend is data-parallel only (every rank holds a shard of every parameter), recomputes
with ``--gradient-checkpointing``, batches by ``--micro-batch-size`` and trains the Hugging Face
model itself, so it refuses the Megatron backend's flags that ask for something
(:data:`INSTEAD` says what it does instead) and ``--use-dynamic-batch-size``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from slime.backends.config import BackendConfig, OtherBackendFlag, gdn_batching_problem, refuse_flags
from slime.utils.config import ConfigError, flag

if TYPE_CHECKING:
    from slime.backends.config import CheckpointConfig, TrainConfig
    from slime.checkpoints.model_args import ModelConfig
    from slime.ray.config import ClusterConfig

_SHARDED = "FSDP shards every parameter over all ranks"
_WHOLE_SEQUENCES = "each rank holds whole sequences"

INSTEAD: dict[str, str] = {
    "tensor_model_parallel_size": _SHARDED,
    "pipeline_model_parallel_size": _SHARDED,
    "expert_model_parallel_size": _SHARDED,
    "expert_tensor_parallel_size": _SHARDED,
    "context_parallel_size": _WHOLE_SEQUENCES,
    "sequence_parallel": _WHOLE_SEQUENCES,
    "recompute_granularity": "use --gradient-checkpointing",
    "recompute_method": "use --gradient-checkpointing",
    "recompute_num_layers": "use --gradient-checkpointing",
    "attention_backend": "use --attn-implementation",
    "megatron_to_hf_mode": "the trained model is the Hugging Face model itself",
    "save_hf": "every FSDP checkpoint holds a Hugging Face model/ folder",
}
"""What the FSDP backend does instead of another backend's flag, by field (default: "a flag of --train-backend X")."""


@dataclasses.dataclass(kw_only=True)
class FSDPConfig(BackendConfig):
    """FSDP backend only (BACKEND_ARGS): the Hugging Face model's attention kernel and activation recompute."""

    attn_implementation: str = flag(
        "sdpa",
        help="Hugging Face attention implementation for the FSDP backend: sdpa, eager, flash_attention_2, ...",
    )
    gradient_checkpointing: bool = flag(False, help="Recompute activations in the backward pass (FSDP backend).")

    def check(
        self,
        *,
        train: TrainConfig,
        model: ModelConfig,
        checkpoint: CheckpointConfig,
        cluster: ClusterConfig,
        other_flags: list[OtherBackendFlag],
    ) -> None:
        """Refuse the other backends' active flags and ``--use-dynamic-batch-size``, all in one message;
        then, for a hybrid Gated-DeltaNet model, ``--micro-batch-size`` above 1 (upstream's GDN limit,
        :func:`slime.backends.config.gdn_batching_problem`).

        Raises:
            ConfigError: naming each such flag, its value and what the FSDP backend does instead.
        """
        refused = [f"{f.text} ({INSTEAD.get(f.field, f'a flag of --train-backend {f.backend}')})" for f in other_flags]
        refused += check_train(train, raise_=False)
        owners = sorted({f.backend for f in other_flags if f.backend}) or ["megatron"]
        refuse_flags("fsdp", refused, f"drop these flags, or use --train-backend {' / '.join(owners)}")
        problem = gdn_batching_problem(model, checkpoint, train, reason="(upstream's limit)")
        if problem:
            raise ConfigError(problem)

    def checkpoint_parts(self) -> tuple[str, ...]:
        """``model/`` (Hugging Face folder, the weights resumed from) and ``trainer/`` (optimizer,
        scheduler, RNG), see :meth:`slime.backends.fsdp.backend.FSDPBackend.save`."""
        return ("model", "trainer")


def check_train(train: TrainConfig, *, raise_: bool = True) -> list[str]:
    """The shared BACKEND_ARGS the FSDP backend does not implement (``--use-dynamic-batch-size``).

    Run at parse time by :meth:`FSDPConfig.check` and by :class:`~slime.backends.fsdp.backend.FSDPBackend`
    when built directly.

    Returns:
        The refused flags with what FSDP does instead (empty when ``raise_`` is set and none is refused).

    Raises:
        ConfigError: with ``raise_``, when a flag is refused.
    """
    refused = []
    if train.use_dynamic_batch_size:
        refused.append("--use-dynamic-batch-size (micro-batches hold --micro-batch-size samples)")
    if raise_:
        refuse_flags("fsdp", refused, "drop it, or use --train-backend megatron")
    return refused
