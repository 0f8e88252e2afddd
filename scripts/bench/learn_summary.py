"""One line of a learning run's ``metrics.jsonl``: reward per rollout, the first rollout at which the mean of 3
consecutive rollouts reaches 0.9 (``tests/test_learning.py``'s criterion), and per step the log-prob gap and router
agreement.  ``python scripts/bench/learn_summary.py RUN_DIR/metrics.jsonl``."""

from __future__ import annotations

import json
import sys


def main(path: str, target: float = 0.9, window: int = 3) -> None:
    rows = [json.loads(line) for line in open(path)]
    steps = sorted((r for r in rows if "rollout/reward_mean" in r), key=lambda r: r["step"])
    rewards = [r["rollout/reward_mean"] for r in steps]
    first = next((k for k in range(window - 1, len(rewards))
                  if sum(rewards[k - window + 1 : k + 1]) / window >= target), None)
    print("rewards", " ".join(f"{x:.2f}" for x in rewards), f"| first {window}-rollout mean >= {target} at rollout",
          first)
    for key in ("train/logprob_abs_diff", "train/router_agreement", "train/tis_weight_mean", "perf/train_time_s"):
        print(key, " ".join(f"{r[key]:.4g}" if key in r else "-" for r in steps))


if __name__ == "__main__":
    main(sys.argv[1])
