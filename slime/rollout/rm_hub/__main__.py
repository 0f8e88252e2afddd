"""Score responses against a label from the command line, to debug a reward function.

    python -m slime.rollout.rm_hub --rm-type geo3k --label '8\\sqrt{3}' '\\boxed{13.86}' 'no box'

prints one reward per response, one per line (``1.0`` then ``0.0`` here), through the training
:class:`~slime.rollout.rm_hub.scorer.RewardScorer` and reward flags.  Failures go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from slime.rollout.rm_hub.answer import last_boxed
from slime.rollout.rm_hub.config import RewardConfig
from slime.rollout.rm_hub.scorer import RewardScorer, RewardStats
from slime.utils.config import ConfigError, add_group, build_group


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), score, print; returns the exit status (2 on a bad flag)."""
    parser = argparse.ArgumentParser(
        prog="python -m slime.rollout.rm_hub",
        description="Print the reward of each RESPONSE against --label, one per line.",
    )
    parser.add_argument("--label", required=True, help="The gold answer, bare LaTeX (e.g. '8\\sqrt{3}').")
    parser.add_argument("--verbose", action="store_true", help="Also print each graded boxed answer to stderr.")
    parser.add_argument("responses", nargs="+", metavar="RESPONSE", help="Model responses to score.")
    add_group(parser, RewardConfig, "reward")
    args = parser.parse_args(argv)
    try:
        cfg = build_group(RewardConfig, args)
        scorer = RewardScorer(cfg)
    except ConfigError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    stats = RewardStats()
    with scorer:
        rewards = scorer.score(args.responses, [args.label] * len(args.responses), stats)
    for index, (response, reward) in enumerate(zip(args.responses, rewards)):
        print(reward)
        if args.verbose:
            print(f"[{index}] boxed answer: {last_boxed(response)!r}", file=sys.stderr)
    if stats.failed:
        print(f"failed responses (scored 0.0): {dataclasses.asdict(stats)}", file=sys.stderr)
    if stats.non_finite:
        print(f"{stats.non_finite} reward(s) not finite (training drops their groups)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
