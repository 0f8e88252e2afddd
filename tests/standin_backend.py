"""A stand-in training backend (not a test module): the step's protocol (:class:`slime.backends.step.StepBackend`) on
a float64 "policy" on the CPU whose log-probability of token ``y`` is ``log sigmoid(F[y] . w)`` (``F`` a fixed feature
table, ``w`` the 3 weights), plain SGD as its update, and a record of what the step asked of it.
``tests/test_train_step.py`` checks the step against a hand computation with it; ``tests/test_routing_replay.py``
gives it a route shape.
"""

from __future__ import annotations

import torch

from slime.backends.config import CheckpointConfig, OptimizerConfig, TrainConfig, TrainerSpec
from slime.backends.handover import HandOver
from slime.backends.step import FORWARD_LOG_PROBS
from slime.backends.train_metrics import DataParallel
from slime.data.sample import Sample
from slime.grpo.config import GRPOConfig
from slime.grpo.loss import grpo_micro_batch_loss

FEATURES = torch.tensor(
    [[0.5, -1.0, 0.25], [1.5, 0.5, -0.5], [-0.75, 1.0, 2.0], [0.1, 0.2, 0.3], [2.0, -1.5, 0.5], [-1.0, -0.5, 1.25]],
    dtype=torch.float64,
)
W0 = [0.3, -0.2, 0.4]
W_REF = [0.1, 0.1, 0.2]
LR, WARMUP, EPS, EPS_HIGH, KL_COEF, ENTROPY_COEF = 0.5, 2, 0.2, 0.28, 0.1, 0.01


class Linear(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(weights, dtype=torch.float64))

    def logits(self, tokens: list[int]) -> torch.Tensor:
        return FEATURES[tokens] @ self.w


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.float64)
    for b, row in enumerate(rows):
        out[b, : len(row)] = row
    return out


class StandIn:
    """Only the step's protocol (:class:`slime.backends.step.StepBackend`), no base class."""

    def __init__(self, grpo: GRPOConfig, *, micro_batch_size=2, clip_grad=1.0, use_rollout_logprobs=False, train=None):
        self.spec = TrainerSpec(
            train=train or TrainConfig(train_backend="fsdp", micro_batch_size=micro_batch_size,
                                       use_rollout_logprobs=use_rollout_logprobs),
            optimizer=OptimizerConfig(lr=LR, lr_warmup_iters=WARMUP, clip_grad=clip_grad),
            grpo=grpo, checkpoint=CheckpointConfig(hf_checkpoint="unused"), rollout_temperature=1.0,
            num_rollout=None, steps_per_rollout=2,
        )
        self.device, self.optimizer_steps, self.dp, self.placeholder_ids = torch.device("cpu"), 0, DataParallel(), set()
        self.model = self.ref_model = None
        self.memory = HandOver(self)
        self.forward_passes: list[tuple[str, list[list[int]]]] = []  # (model, micro-batches' indices)
        self.steps: list[dict] = []  # per optimizer step: micro-batch sizes, normaliser, lr, grad scale

    def init(self) -> int:
        self.model = Linear(W0)
        self.ref_model = Linear(W_REF) if self.spec.grpo.needs_ref_model else None
        return 0

    def pack(self, samples):
        return None

    def route_shape(self):
        raise NotImplementedError("the stand-in has no MoE layers")

    def log_probs(self, model, batches, *, replay_routes=False, capture_routes=False):
        self.forward_passes.append(("ref" if model is self.ref_model else "policy", [b.indices for b in batches]))
        with torch.no_grad():
            return [torch.nn.functional.logsigmoid(model.logits(s.response_token_ids)) for b in batches
                    for s in b.samples]

    def forward_backward(self, batches, normalizer):
        self.steps.append({"micro_batches": [len(b.samples) for b in batches], "normalizer": normalizer})
        out = []
        for batch in batches:
            logits = [self.model.logits(s.response_token_ids) for s in batch.samples]
            log_p = [torch.nn.functional.logsigmoid(z) for z in logits]
            entropy = [-(torch.sigmoid(z) * lp + torch.sigmoid(-z) * torch.nn.functional.logsigmoid(-z))
                       for z, lp in zip(logits, log_p)]
            loss, terms = grpo_micro_batch_loss(
                _padded(log_p), None if batch.old_log_probs is None else _padded(batch.old_log_probs),
                torch.tensor([s.advantage for s in batch.samples], dtype=torch.float64),
                _padded([torch.tensor(s.loss_mask, dtype=torch.float64) for s in batch.samples]), self.spec.grpo,
                global_normalizer=normalizer, entropy=_padded(entropy),
                ref_log_probs=None if batch.ref_log_probs is None else _padded(batch.ref_log_probs),
                rollout_log_probs=None if batch.rollout_log_probs is None else _padded(batch.rollout_log_probs),
                advantage_whitening=batch.advantage_whitening,
            )
            loss.backward()
            out.append({"loss": loss.detach(), **terms})
            if batch.old_log_probs is None:  # --skip-actor-forward-only
                out[-1][FORWARD_LOG_PROBS] = [lp.detach() for lp in log_p]
        return out

    def grad_norm(self) -> float:
        return float(self.model.w.grad.norm())

    def apply_update(self, lr, grad_scale):
        self.steps[-1].update(lr=lr, grad_scale=grad_scale)
        with torch.no_grad():
            self.model.w -= lr * grad_scale * self.model.w.grad
        self.model.w.grad = None
        return {}


def hand_samples() -> list[Sample]:
    """6 samples = 2 optimizer steps of 3; response tokens, loss masks, advantages and rollout log-probs
    chosen by hand; samples 1 and 4 have an image prompt."""
    rows = [  # (response tokens, loss mask, advantage, image prompt)
        ([0, 1, 2], [1, 1, 0], 1.0, False), ([3, 4], [1, 1], -0.5, True), ([5, 0, 2, 1], [1, 0, 1, 1], 0.8, False),
        ([1, 1], [1, 1], -1.2, False), ([2, 3, 4], [0, 1, 1], 0.6, True), ([4, 5, 0], [1, 1, 1], -0.3, False),
    ]  # fmt: skip
    return [
        Sample(index=i, group_index=i // 2, prompt="p", label="1", images=["img"] if image else [],
               prompt_token_ids=[7, 8], response_token_ids=tokens, loss_mask=mask, advantage=advantage,
               rollout_log_probs=[-0.6 - 0.1 * t - 0.05 * i for t in range(len(tokens))])
        for i, (tokens, mask, advantage, image) in enumerate(rows)
    ]


GRPO = dict(eps_clip=EPS, eps_clip_high=EPS_HIGH, use_kl_loss=True, kl_loss_coef=KL_COEF, kl_loss_type="k3",
            entropy_coef=ENTROPY_COEF)
