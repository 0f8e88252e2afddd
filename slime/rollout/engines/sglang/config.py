"""Parse-time checks of ``--rollout-backend sglang`` (importable without SGLang): the server arguments that would
break what the engine relies on are refused, naming the flag and the fix.  The flags themselves:
:mod:`slime.rollout.engines.sglang.flags`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slime.rollout.engines.config import EngineConfig
from slime.rollout.engines.sglang.flags import SGLangConfig, _dashed, requests_per_call
from slime.utils.config import ConfigError

if TYPE_CHECKING:
    from slime.rollout.config import RolloutConfig


REFUSED = {
    "api_key": "slime gives every server a per-run secret of its own (never printed); remove it",
    "admin_api_key": "slime gives every server a per-run secret of its own (never printed); remove it",
    "base_gpu_id": "slime sets CUDA_VISIBLE_DEVICES to the engine's GPUs and --base-gpu-id 0; remove it",
    "nnodes": "an SGLang engine spans one node here; use --rollout-num-gpus-per-engine <= GPUs per node",
    "node_rank": "an SGLang engine spans one node here; remove it",
    "dist_init_addr": "an SGLang engine spans one node here; remove it",
    "nccl_init_addr": "SGLang's other name for --dist-init-addr; an SGLang engine spans one node here: remove it",
    "skip_tokenizer_init": "slime sends prompt text and reads the decoded response; remove it",
    "grpc_port": "the gRPC listener bypasses SGLang's API-key check; remove it",
    "grpc_mode": "SGLang's legacy gRPC server (on --port + 10000) never checks the API key; remove it",
    "smg_grpc_mode": "SGLang's legacy gRPC server (on --port + 10000) never checks the API key; remove it",
    "config": "SGLang merges the file's settings past slime's checks of these flags (e.g. grpc-port, "
    "tokenizer-worker-num); give each setting as an --sglang-<name> flag instead",
    "crash_dump_folder": "SGLang pickles its server arguments, the per-run secret among them, into that folder when "
    "the server crashes or is stopped (slime stops it with SIGTERM); remove it",
    "router_ip": "slime balances requests over its engines itself (per request, retrying a dead engine's "
    "requests elsewhere); sglang-router is not used: remove it",
    "router_port": "slime balances requests over its engines itself; sglang-router is not used: remove it",
}
"""Server arguments the engine sets itself or cannot work with, and why."""

MTP_SPECULATIVE_FLAGS = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
                         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")
"""Upstream's recipe's speculative decoding with the checkpoint's MTP layer (SGLang's flag names; the launcher's
``SLIME_SCRIPT_SPECULATIVE=mtp`` passes them as ``--sglang-*``): 2 draft steps of 1 token, 3 tokens verified."""
MTP_ALGORITHMS = ("EAGLE", "NEXTN")
"""``--speculative-algorithm`` values with which SGLang drafts with the checkpoint's own MTP layer when no
``--speculative-draft-model-path`` is given (NEXTN is SGLang's alias of EAGLE)."""

CHECKED = ("tokenizer_worker_num", "dp_size", "data_parallel_size", "enable_dp_attention",
           "enable_tokenizer_batch_encode", "speculative_algorithm", "speculative_draft_model_path")
"""Server arguments whose values :meth:`SGLangEngineConfig.check` checks (an abbreviation of one is refused too)."""


class SGLangEngineConfig(EngineConfig):
    """Checks of the SGLang engine's flags (see the module docstring)."""

    parity_check = True

    @classmethod
    def check(cls, rollout: RolloutConfig, sglang: SGLangConfig, hf_checkpoint: str | None = None) -> None:
        """Raises:
        ConfigError: a refused server argument (:data:`REFUSED`) or an abbreviation of one of them or of
            :data:`CHECKED` (SGLang's argparse would expand it past these checks), ``--sglang-tokenizer-worker-num``
            above 1 (SGLang 0.5.17 enforces API keys only with one tokenizer worker), ``--sglang-dp-size``
            above 1 without ``--sglang-enable-dp-attention`` (SGLang's weight updates need it), or a
            bad ``--sglang-server-concurrency`` or ``--sglang-requests-per-call``, or
            ``--sglang-enable-tokenizer-batch-encode`` with ``--sglang-requests-per-call`` above 1 (SGLang 0.5.17
            then refuses every batched ``/generate`` that holds an image: ``tokenizer_manager.py``,
            ``_validate_batch_tokenization_constraints``), or ``--sglang-speculative-algorithm`` EAGLE / NEXTN
            without ``--sglang-speculative-draft-model-path`` on a local ``hf_checkpoint`` without an MTP layer
            (:func:`slime.checkpoints.mtp.mtp_problem`).
        """
        args = sglang.server_args
        for given in args:  # SGLang's argparse expands a unique prefix (allow_abbrev): --grpc-por is --grpc-port
            full = next((n for n in (*REFUSED, *CHECKED) if n != given and n.startswith(given)), None)
            if full is not None:
                raise ConfigError(
                    f"--sglang-{_dashed(given)} abbreviates --sglang-{_dashed(full)} (SGLang's parser expands it), "
                    f"which slime checks: write the full name, or drop it"
                )
        for name, why in REFUSED.items():
            if name in args:
                raise ConfigError(f"--sglang-{_dashed(name)} is not passed through: {why}")
        workers = args.get("tokenizer_worker_num")
        if workers is not None and workers != "1":
            raise ConfigError(
                f"--sglang-tokenizer-worker-num {workers}: SGLang 0.5.17 checks API keys only with one tokenizer "
                "worker, so the server would accept weight updates from anyone; remove it (default 1)"
            )
        dp = args.get("dp_size", args.get("data_parallel_size"))
        if dp is not None and dp != "1" and "enable_dp_attention" not in args:
            raise ConfigError(
                f"--sglang-dp-size {dp}: SGLang updates weights from tensors only with --dp-size 1 or DP attention; "
                "add --sglang-enable-dp-attention, or run more engines (--rollout-num-gpus) instead"
            )
        batched = requests_per_call(sglang) > 1  # checks --sglang-server-concurrency too
        if batched and "enable_tokenizer_batch_encode" in args:
            raise ConfigError(
                "--sglang-enable-tokenizer-batch-encode: SGLang 0.5.17 then refuses every batched /generate call "
                "that holds an image prompt ('For multimodal input processing do not set "
                "enable_tokenizer_batch_encode'), and slime sends up to --sglang-requests-per-call requests per call; "
                "remove it, or add --sglang-requests-per-call 1 (which leaves it nothing to batch)"
            )
        _check_mtp_draft(args, hf_checkpoint)


def _check_mtp_draft(args: dict, hf_checkpoint: str | None) -> None:
    """Speculative decoding that drafts with the checkpoint's own MTP layer needs a checkpoint that has one."""
    from slime.checkpoints.mtp import mtp_problem

    algorithm = args.get("speculative_algorithm")
    if not isinstance(algorithm, str) or algorithm.upper() not in MTP_ALGORITHMS:
        return
    if "speculative_draft_model_path" in args or not hf_checkpoint:
        return
    try:
        problem = mtp_problem(hf_checkpoint)
    except ValueError as e:
        raise ConfigError(f"--hf-checkpoint {hf_checkpoint}: {e}") from None
    if problem:
        raise ConfigError(
            f"--sglang-speculative-algorithm {algorithm} drafts with the checkpoint's MTP layer, but --hf-checkpoint "
            f"{hf_checkpoint} has none: {problem}. Use a checkpoint with its MTP layer (the released Qwen3.5 ones; "
            "scripts/tools/make_scaled_qwen35.py adds a random one), give "
            "--sglang-speculative-draft-model-path, or drop the --sglang-speculative-* flags (SLIME_SCRIPT_SPECULATIVE=off)"
        )
