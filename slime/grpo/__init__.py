"""GRPO: the algorithm's math, shared by every training backend.

- :mod:`.config`: the GRPO flags (GRPO_ARGS) and the advantage-estimator registry (no torch);
- :mod:`.advantages`: rewards of a prompt's group -> one advantage per response;
- :mod:`.log_probs`: logits -> per-token log-probs and entropies (full or vocab-parallel);
- :mod:`.loss`: the policy loss, KL estimators, aggregation and the micro-batch loss.
"""
