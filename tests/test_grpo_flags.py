"""Upstream slime's loss and rollout flags on the command line: each parses, is read, shows in ``--help`` and has a
line in the flag docs; the combinations in which one would do nothing are refused naming the flag; the departures
table of ``docs/design/grpo.md`` names every flag it should.  CPU only, no checkpoint on disk."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slime.arguments import build_parser, config_to_argv, parse_args
from slime.grpo.config import GRPOConfig

ROOT = Path(__file__).resolve().parents[1]
BASE = ("--hf-checkpoint not-on-disk --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 "
        "--rollout-max-response-len 64 --train-backend fsdp --rollout-backend transformers --colocate").split()

# flag -> (command line, what the parsed config must hold): the list, in upstream's spelling
UPSTREAM_FLAGS = {
    "--eps-clip-c": ("--eps-clip-c 3", lambda c: c.grpo.eps_clip_c == 3.0),
    "--advantage-estimator": ("--advantage-estimator cispo", lambda c: c.grpo.cispo),
    "--normalize-advantages": ("--normalize-advantages", lambda c: c.grpo.normalize_advantages),
    "--gamma": ("--advantage-estimator reinforce_plus_plus --normalize-advantages --gamma 0.9",
                lambda c: c.grpo.reinforce_plus_plus_returns and c.grpo.gamma == 0.9),
    "--use-unbiased-kl": ("--use-kl-loss --kl-loss-coef 0.1 --use-unbiased-kl", lambda c: c.grpo.use_unbiased_kl),
    "--custom-pg-loss-reducer-function-path": (
        "--custom-pg-loss-reducer-function-path tests.test_grpo_reference.dr_grpo_budget",
        lambda c: c.grpo.custom_pg_loss_reducer_function_path == "tests.test_grpo_reference:dr_grpo_budget"),
    "--get-mismatch-metrics": ("--get-mismatch-metrics",
                               lambda c: c.grpo.get_mismatch_metrics and c.grpo.needs_rollout_log_probs),
    "--disable-rewards-normalization": ("--disable-rewards-normalization",
                                        lambda c: c.grpo.disable_rewards_normalization),
    "--kl-loss-type": ("--kl-loss-type k3", lambda c: c.grpo.kl_loss_type == "k3"),
}
REFUSED = {  # upstream flags parsed and refused with the reason
    "--partial-rollout": ("--partial-rollout", "--partial-rollout .*is not supported: the rollout engines here cannot "
                          "resume a half-made response"),
    "--advantage-estimator ppo": ("--advantage-estimator ppo", "--advantage-estimator ppo: upstream's PPO takes GAE "
                                  "advantages from a critic .*which this project does not train"),
}


def parse(extra: str):
    return parse_args(BASE + extra.split())


def refused(extra: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(extra)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("name", UPSTREAM_FLAGS)
def test_each_upstream_flag_parses_is_read_and_round_trips(name):
    argv, holds = UPSTREAM_FLAGS[name]
    cfg = parse(argv)
    assert holds(cfg)
    assert parse_args(config_to_argv(cfg)) == cfg


def test_every_flag_is_in_help_and_in_the_flag_docs():
    text = build_parser().format_help()
    docs = (ROOT / "docs" / "design" / "grpo.md").read_text() + (ROOT / "README.md").read_text()
    for flag in [*UPSTREAM_FLAGS, "--partial-rollout"]:
        assert re.search(rf"{flag}\b", text), f"{flag} not in --help"
        assert f"`{flag}" in docs, f"{flag} not in README.md / docs/design/grpo.md"
    for value in ("cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"):
        assert value in text and f"`{value}`" in docs


def test_kl_loss_type_defaults_to_upstreams_k1_and_the_launcher_passes_its_own():
    # (with --use-kl-loss only: tests/test_launcher.py::test_upstreams_kl_loss_type_is_passed_only_with_the_kl_loss)
    assert parse("").grpo.kl_loss_type == "k1" and GRPOConfig().kl_loss_type == "k1"
    launcher = (ROOT / "examples" / "geo3k_vlm" / "run_geo3k_qwen35.sh").read_text()
    assert "--kl-loss-type low_var_kl" in launcher


@pytest.mark.parametrize("name", REFUSED)
def test_refused_upstream_flags_say_why(name, capsys):
    argv, message = REFUSED[name]
    assert re.search(message, refused(argv, capsys))


@pytest.mark.parametrize("argv,message", [
    ("--eps-clip-c 1", "--eps-clip-c must be > 1"),
    ("--eps-clip-c 3 --advantage-estimator cispo", "--eps-clip-c 3.0 bounds PPO's clipped loss, which cispo does not"),
    ("--advantage-estimator reinforce_plus_plus", "reinforce_plus_plus needs --normalize-advantages"),
    ("--advantage-estimator reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline needs --normalize-advantages"),
    ("--gamma 0.9", "--gamma 0.9 discounts reinforce_plus_plus's returns only"),
    ("--gamma 1.5 --advantage-estimator reinforce_plus_plus --normalize-advantages", r"--gamma must be in \[0, 1\]"),
    ("--use-unbiased-kl", "--use-unbiased-kl reweights the KL loss, which is off; add --use-kl-loss"),
    ("--disable-rewards-normalization --disable-grpo-std-normalization",
     "--disable-grpo-std-normalization has no effect: --disable-rewards-normalization turns off"),
    ("--advantage-estimator dr_grpo --disable-grpo-std-normalization",
     "--disable-grpo-std-normalization has no effect: --advantage-estimator dr_grpo never divides by the std"),
    ("--get-mismatch-metrics --use-rollout-logprobs", "--get-mismatch-metrics with --use-rollout-logprobs"),
    ("--get-mismatch-metrics --debug-rollout-only", "--debug-rollout-only runs no training step, so "
     "--get-mismatch-metrics would do nothing"),
    ("--custom-pg-loss-reducer-function-path reducer", "--custom-pg-loss-reducer-function-path 'reducer' is not a "
     "path"),
    ("--eps-clip 1.5", r"--eps-clip must be in \[0, 1\] \(the ratio's lower clip bound is 1 - eps_clip.*got 1.5"),
    ("--entropy-coef -1", "--entropy-coef must be >= 0, got -1.0"),
])
def test_combinations_that_would_do_nothing_are_refused(argv, message, capsys):
    assert re.search(message, refused(argv, capsys))


@pytest.mark.parametrize("argv, logger, warning", [
    ("--kl-loss-type low_var_kl", "slime.arguments", "--kl-loss-type low_var_kl has no effect without --use-kl-loss"),
    ("--rm-tolerance 0.1", "slime.rollout.rm_hub.config",
     "--rm-tolerance 0.1 has no effect with --rm-type math, which does not read it"),
    ("--rm-type deepscaler --rm-tolerance 0", "slime.rollout.rm_hub.config",
     "--rm-tolerance 0 has no effect with --rm-type deepscaler"),
])  # fmt: skip
def test_a_flag_that_does_nothing_warns_naming_it(argv, logger, warning, caplog):
    with caplog.at_level("WARNING", logger=logger):
        parse(argv)
    assert warning in caplog.text


@pytest.mark.parametrize("argv", ["--use-kl-loss --kl-loss-coef 0.1 --kl-loss-type low_var_kl", "--kl-loss-type k1",
                                  "--rm-type geo3k --rm-tolerance 0.1", "--custom-rm-path tests.rewards:odd_length_reward "
                                  "--rm-tolerance 0.1", "--eps-clip 1 --advantage-estimator cispo --eps-clip-high 4"])
def test_the_same_flags_where_they_act_are_quiet(argv, caplog):
    with caplog.at_level("WARNING"):
        parse(argv)
    assert "has no effect" not in caplog.text


def test_cispo_with_a_lower_clip_bound_warns_as_upstream(caplog):
    with caplog.at_level("WARNING", logger="slime.arguments"):
        parse("--advantage-estimator cispo")
    assert "--advantage-estimator cispo with --eps-clip 0.2 keeps the lower clip bound 0.8" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="slime.arguments"):
        parse("--advantage-estimator cispo --eps-clip 1 --eps-clip-high 4")
    assert "cispo" not in caplog.text


def test_the_departures_table_names_every_departure():
    doc = (ROOT / "docs" / "design" / "grpo.md").read_text()
    table = doc.split("## Departures from upstream")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| flag")]
    named = " ".join(row.split("|")[1] for row in rows)
    for flag in ("--advantage-estimator ppo", "--partial-rollout", "--calculate-per-token-loss", "--kl-coef",
                 "--custom-tis-function-path", "--custom-pg-loss-reducer-function-path", "--get-mismatch-metrics",
                 "--use-opsm", "--dynamic-sampling-filter-path", "--tis-mode", "--n-samples-per-prompt",
                 "--custom-rm-path"):
        assert flag in named, f"no departure row for {flag}"
    assert all(len(row.split("|")) == 6 for row in rows), "each row: flag | upstream | ours | why"
