"""The launcher, ``examples/geo3k_vlm/run_geo3k_qwen35.sh``, as a user runs it (CPU default).

- The acceptance run: ``--num-rollout 3`` on the bundled geo3k rows with 2 trainer ranks and
  1 engine leaves a metrics JSONL, a PNG reward curve and a checkpoint that transformers
  loads, and nothing of its Ray instance running afterwards.
- ``SLIME_SCRIPT_DRY_RUN=1`` prints a command that the argument parser accepts; extra
  arguments come last and win.
- SIGTERM to the launcher mid-run stops the driver and every process of its Ray instance
  before the launcher exits, and nothing else (decoys named like Ray's processes survive).
- SIGKILL of the launcher (which it cannot trap) stops the run too, within seconds, through the
  driver's ``--parent-pid`` watch; the checkpoint folder is not written after the kill.
- The resume line it prints once a run started (never before: none for a run that did not start)
  reproduces the run's folders, a custom ``--save`` included, and repeats no flag; a used or live
  run directory is refused before anything is written.
- ``--check-only`` prints the check's result only; a switch (``SLIME_SCRIPT_DRY_RUN`` ...) other
  than 0 / 1 / empty is refused; relative path flags are taken from where the launcher is run.

The launcher runs with ``SLIME_SKIP_SETUP=1`` and this interpreter first on ``PATH`` (no
install, no download), ``SLIME_SCRIPT_FORCE_CPU=1`` and ``SLIME_SCRIPT_OUTPUT_DIR`` in tmp.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from slime.arguments import parse_args
from slime.checkpoints import layout as ckpt
from slime.utils.metrics import read_metrics
from tests.process_tree import all_processes, kill_session, session_members, wait_for, wait_session_gone

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "examples" / "geo3k_vlm" / "run_geo3k_qwen35.sh"
DATA_DIR = REPO / "examples" / "geo3k_vlm" / "data"
RUN_TIMEOUT_S = 600
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STEP_KEYS = (
    "rollout/reward_mean", "rollout/truncated_frac", "rollout/num_samples",
    "train/logprob_abs_diff", "train/logprob_abs_diff_image",
    "perf/rollout_time_s", "perf/train_time_s", "perf/sync_time_s",
)  # fmt: skip


def _env(out_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_SCRIPT_EXTERNAL_RAY", "SLIME_SCRIPT_DRY_RUN")}
    env.update(
        SLIME_SKIP_SETUP="1",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p),
        SLIME_SCRIPT_FORCE_CPU="1",
        SLIME_SCRIPT_OUTPUT_DIR=str(out_dir),
        HF_HUB_OFFLINE="1",
        WANDB_MODE="offline",
        RAY_USAGE_STATS_ENABLED="0",
        **extra,
    )
    return env


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", str(LAUNCHER), *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _driver_of(launcher: subprocess.Popen):
    """The launcher's driver process (``python -m slime.train``, leader of its own session), or None."""
    for proc in all_processes():
        if proc.ppid == launcher.pid and "slime.train" in proc.cmdline and proc.sid == proc.pid:
            return proc
    return None


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@pytest.mark.slow
def test_cpu_default_run_leaves_metrics_plot_and_checkpoint(tiny_ckpt, tmp_path):
    out, log = tmp_path / "run", tmp_path / "launcher.log"
    launcher = _start(["--num-rollout", "3"], _env(out), log)
    driver = None
    try:
        driver = wait_for(lambda: _driver_of(launcher), RUN_TIMEOUT_S, "the driver to start", launcher)
        assert launcher.wait(timeout=RUN_TIMEOUT_S) == 0, _tail(log)
        survivors = session_members(driver.sid)
        assert not survivors, "processes of the finished run still run:\n" + "\n".join(map(str, survivors))
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if driver is not None:
            kill_session(driver.sid)
    text = log.read_text()
    assert f"[geo3k] done. Output: {out}" in text

    # The command it ran: the bundled data, 2 trainer ranks, >= 1 engine, our extra flag last.
    argv = shlex.split((out / "command.sh").read_text())  # written by the driver, without --parent-pid
    assert Path(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "slime.train"]
    assert argv[-2:] == ["--num-rollout", "3"]
    cfg = parse_args(argv[3:])
    assert Path(cfg.data.prompt_data) == DATA_DIR
    assert cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node == 2
    assert cfg.cluster.rollout_num_gpus >= 1 and cfg.rollout.num_rollout == 3
    placement = re.search(r"placement: (\d+) trainer rank\(s\), (\d+) engine\(s\)", text)
    assert placement and int(placement[1]) == 2 and int(placement[2]) >= 1, text[-2000:]

    # Metrics: one record per rollout step 0..2 with reward, truncation, log-prob gap and timing keys.
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [0, 1, 2], records
    for record in steps:
        missing = [key for key in STEP_KEYS if key not in record]
        assert not missing, (missing, record)
        assert all(math.isfinite(record[key]) for key in STEP_KEYS), record
        assert record["rollout/num_samples"] == cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        assert record["data/skipped_bad_image"] == record["data/skipped_prompt_too_long"] == 0, record
        # fp32 engine and fp32 trainer at the same (synced) weights: only summation order differs.
        assert record["train/logprob_abs_diff_image"] < 1e-4, record
    assert "perf/save_time_s" in steps[-1]
    assert [r["step"] for r in records if "eval/geo3k/accuracy" in r] == [0, 3]  # before training, after the last

    # The reward curve is a real PNG image.
    plot = out / "reward_curve.png"
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(plot) as image:
        image.verify()
        assert image.format == "PNG" and min(image.size) > 100

    # The checkpoint: the last step, an HF folder transformers loads, with the initial model's tensors.
    from transformers import AutoModelForImageTextToText

    root = Path(cfg.checkpoint.save)
    assert ckpt.latest_iteration(root) == 2
    trained = AutoModelForImageTextToText.from_pretrained(ckpt.model_dir(root, 2))
    initial = AutoModelForImageTextToText.from_pretrained(tiny_ckpt)
    shapes = {name: tuple(t.shape) for name, t in initial.state_dict().items()}
    assert {name: tuple(t.shape) for name, t in trained.state_dict().items()} == shapes
    assert (ckpt.trainer_dir(root, 2) / "scheduler.pt").is_file()


def test_dry_run_prints_a_parsable_command_with_extra_args_last(tiny_ckpt, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        ["bash", str(LAUNCHER), "--num-rollout", "2", "--rollout-seed", "5"],
        cwd=REPO, env=_env(out, SLIME_SCRIPT_DRY_RUN="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv[:3] == ["python", "-m", "slime.train"]
    assert argv[-4:] == ["--num-rollout", "2", "--rollout-seed", "5"]
    assert argv.count("--num-rollout") == 2  # the default, then ours
    cfg = parse_args(argv[3:])
    assert cfg.rollout.num_rollout == 2 and cfg.rollout.rollout_seed == 5
    assert Path(cfg.checkpoint.hf_checkpoint) == Path(tiny_ckpt)
    assert Path(cfg.logging.output_dir) == out
    assert not out.exists()  # a dry run writes nothing


@pytest.mark.parametrize("extra, kl_type", [((), None), (("--use-kl-loss", "--kl-loss-coef", "0.01"), "low_var_kl")])
def test_upstreams_kl_loss_type_is_passed_only_with_the_kl_loss(tiny_ckpt, tmp_path, extra, kl_type, caplog):
    # Without --use-kl-loss the flag does nothing, and the parser warns about it: the launcher leaves it out.
    result = subprocess.run(["bash", str(LAUNCHER), *extra], cwd=REPO, env=_env(tmp_path / "run",
                            SLIME_SCRIPT_DRY_RUN="1"), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert (argv[argv.index("--kl-loss-type") + 1] if "--kl-loss-type" in argv else None) == kl_type
    with caplog.at_level("WARNING"):
        cfg = parse_args(argv[3:])
    assert cfg.grpo.kl_loss_type == (kl_type or "k1") and "has no effect" not in caplog.text


@pytest.mark.slow
def test_cpu_default_honours_an_explicit_rollout_backend(tiny_ckpt, tmp_path):
    """SLIME_SCRIPT_ROLLOUT_BACKEND set on a machine without a GPU is passed on (the driver then refuses sglang
    with its reason) rather than silently replaced by the transformers engine; unset, the CPU default's."""
    for env_extra, engine in (({}, "transformers"), ({"SLIME_SCRIPT_ROLLOUT_BACKEND": "sglang"}, "sglang")):
        result = subprocess.run(
            ["bash", str(LAUNCHER)], cwd=REPO, env=_env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", **env_extra),
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        argv = shlex.split(result.stdout.strip().splitlines()[-1])
        assert argv[argv.index("--rollout-backend") + 1] == engine
        assert f"{engine} engine" in result.stdout + result.stderr


def test_speculative_mtp_adds_upstreams_four_flags_which_the_parser_checks(tiny_ckpt, tmp_path, capsys):
    """SLIME_SCRIPT_SPECULATIVE=mtp adds exactly upstream's four --sglang-speculative-* flags (unset: none); the parser
    refuses them on the tiny checkpoint, which has no MTP layer, and with the transformers engine; a value other
    than off / mtp stops the launcher."""
    from slime.rollout.engines.sglang.config import MTP_SPECULATIVE_FLAGS

    expected = ["--sglang-" + f[2:] if f.startswith("--") else f for f in MTP_SPECULATIVE_FLAGS]
    assert expected[:2] == ["--sglang-speculative-algorithm", "EAGLE"] and len(expected) == 8
    runs = {}
    for value in (None, "off", "mtp"):
        for engine in ("sglang", "transformers"):
            extra = {"SLIME_SCRIPT_ROLLOUT_BACKEND": engine, **({"SLIME_SCRIPT_SPECULATIVE": value} if value else {})}
            result = subprocess.run(
                ["bash", str(LAUNCHER)], cwd=REPO, env=_env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", **extra),
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            runs[value, engine] = shlex.split(result.stdout.strip().splitlines()[-1])
    for (value, engine), argv in runs.items():
        flags = [a for a in argv if a.startswith("--sglang-speculative")]
        assert flags == (expected[::2] if value == "mtp" else []), (value, engine)
    argv = runs["mtp", "sglang"]
    start = argv.index("--sglang-speculative-algorithm")
    assert argv[start:start + 8] == expected
    with pytest.raises(SystemExit):
        parse_args(argv[3:])
    assert "has none: config.json has no mtp_num_hidden_layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(runs["mtp", "transformers"][3:])
    assert "does not run SGLang" in capsys.readouterr().err
    bad = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=_env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", SLIME_SCRIPT_SPECULATIVE="eagle"))
    assert bad.returncode == 2 and "SLIME_SCRIPT_SPECULATIVE=eagle: expected off or mtp" in bad.stderr


@pytest.mark.slow
def test_mtp_on_a_card_under_120_gib_lowers_sglangs_memory_fraction_to_0_6(tiny_ckpt, tmp_path):
    """The GPU recipe gives SGLang upstream's ``--sglang-mem-fraction-static 0.7``; with SLIME_SCRIPT_SPECULATIVE=mtp on
    a card under 120 GiB 0.6 (0.7 killed the MTP server at start-up on an 80 GB H100: out of memory with 23 GB left
    after its pools), 0.7 again on a 141 GiB card or without MTP; an explicit ``--sglang-mem-fraction-static`` among
    the extra arguments is passed after it, so it wins (argparse keeps the last)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        def start(gib: str, spec: str, *args: str) -> concurrent.futures.Future:
            return pool.submit(_gpu_dry_run, tmp_path, 1, tiny_ckpt, args, SLIME_TEST_FAKE_GPU_GIB=gib,
                               SLIME_SCRIPT_ROLLOUT_BACKEND="sglang", SLIME_SCRIPT_SPECULATIVE=spec)

        runs = {(gib, spec, args): start(gib, spec, *args)
                for gib, spec, args in (("79", "mtp", ()), ("79", "off", ()), ("141", "mtp", ()),
                                        ("79", "mtp", ("--sglang-mem-fraction-static", "0.5")))}

    def fractions(key) -> list[str]:
        result = runs[key].result()
        assert result.returncode == 0, result.stderr
        argv = shlex.split(result.stdout.strip().splitlines()[-1])
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--sglang-mem-fraction-static"]

    assert fractions(("79", "mtp", ())) == ["0.6"]
    assert fractions(("79", "off", ())) == ["0.7"]
    assert fractions(("141", "mtp", ())) == ["0.7"]
    assert fractions(("79", "mtp", ("--sglang-mem-fraction-static", "0.5")))[-1] == "0.5"


def _gpu_dry_run(tmp_path: Path, gpus: int, tiny_ckpt, args: tuple[str, ...] = (), **extra: str
                 ) -> subprocess.CompletedProcess:
    """The launcher's GPU branch, dry-run on this CPU machine with ``gpus`` GPUs faked
    (``tests/fixtures/fake_gpus/sitecustomize.py``), the tiny checkpoint's model file and the transformers engine
    (sglang is not installed here; ``SLIME_SCRIPT_ROLLOUT_BACKEND`` in ``extra`` chooses another)."""
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", SLIME_TEST_FAKE_GPUS=str(gpus),
               SLIME_SCRIPT_NUM_GPUS=str(gpus), SLIME_SCRIPT_MODEL_NAME="qwen3.5-tiny",
               SLIME_SCRIPT_HF_CHECKPOINT=str(tiny_ckpt), **{"SLIME_SCRIPT_ROLLOUT_BACKEND": "transformers", **extra})
    env["SLIME_SCRIPT_FORCE_CPU"] = "0"  # sglang is not installed here: the transformers engine
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "fixtures" / "fake_gpus"), env["PYTHONPATH"]])
    return subprocess.run(["bash", str(LAUNCHER), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_gpu_default_packs_micro_batches_on_one_gpu_and_keeps_upstreams_batching_elsewhere(tiny_ckpt, tmp_path,
                                                                                           capsys):
    """One GPU (TP = EP = 1, where packing a Gated-DeltaNet model is proven): ``--use-dynamic-batch-size
    --max-tokens-per-gpu 8192`` by default on a card of 120 GiB or more (4096 on an 80 GB one), N with SLIME_SCRIPT_MAX_TOKENS_PER_GPU=N, none with 0; more GPUs: upstream's
    one sample per micro-batch, and asking for packing there is refused by the parser (EP > 1); a value that is not a
    count stops the launcher.  The parser takes the GPU branch's whole command (it refused upstream's
    ``--attention-softmax-in-fp32`` there once, unseen by any CPU test), with R3 too (selective recompute)."""
    # The launcher's dry runs of this test, all started first.
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        def start(gpus: int, *args: str, **extra: str) -> concurrent.futures.Future:
            return pool.submit(_gpu_dry_run, tmp_path, gpus, tiny_ckpt, args, **extra)

        runs = dict(
            one=start(1), one_4096=start(1, SLIME_SCRIPT_MAX_TOKENS_PER_GPU="4096"),
            h100=start(1, SLIME_TEST_FAKE_GPU_GIB="79"),
            h100_8192=start(1, SLIME_TEST_FAKE_GPU_GIB="79", SLIME_SCRIPT_MAX_TOKENS_PER_GPU="8192"),
            one_0=start(1, SLIME_SCRIPT_MAX_TOKENS_PER_GPU="0"), two=start(2),
            two_4096=start(2, SLIME_SCRIPT_MAX_TOKENS_PER_GPU="4096"),
            bad=start(1, SLIME_SCRIPT_MAX_TOKENS_PER_GPU="8k"),
            r3=start(1, "--use-rollout-routing-replay"), mine=start(1, "--recompute-granularity", "selective"),
            none=start(1, SLIME_SCRIPT_RECOMPUTE="none"), sel=start(1, SLIME_SCRIPT_RECOMPUTE="selective"),
            r3_full=start(1, "--use-rollout-routing-replay", SLIME_SCRIPT_RECOMPUTE="full"),
            both=start(1, "--recompute-granularity", "full", SLIME_SCRIPT_RECOMPUTE="none"),
            bad_rc=start(1, SLIME_SCRIPT_RECOMPUTE="off"),
            fsdp=start(1, SLIME_SCRIPT_TRAIN_BACKEND="fsdp"),
            fsdp_none=start(1, SLIME_SCRIPT_TRAIN_BACKEND="fsdp", SLIME_SCRIPT_RECOMPUTE="none"),
            fsdp_sel=start(1, SLIME_SCRIPT_TRAIN_BACKEND="fsdp", SLIME_SCRIPT_RECOMPUTE="selective"),
        )  # fmt: skip

    def argv(name: str) -> list[str]:
        result = runs[name].result()
        assert result.returncode == 0, result.stderr
        return shlex.split(result.stdout.strip().splitlines()[-1])

    def packing(args: list[str]) -> str | None:
        return args[args.index("--max-tokens-per-gpu") + 1] if "--use-dynamic-batch-size" in args else None

    one = argv("one")
    assert packing(one) == "8192" and "--micro-batch-size" in one
    cfg = parse_args(one[3:])
    assert cfg.train.use_dynamic_batch_size and cfg.train.max_tokens_per_gpu == 8192
    assert packing(argv("one_4096")) == "4096"
    assert packing(argv("h100")) == "4096"  # an 80 GB H100: half the tokens
    assert packing(argv("h100_8192")) == "8192"
    assert packing(argv("one_0")) is None
    two = argv("two")
    assert packing(two) is None and not parse_args(two[3:]).train.use_dynamic_batch_size
    with pytest.raises(SystemExit):
        parse_args(argv("two_4096")[3:])
    assert "Gated-DeltaNet" in capsys.readouterr().err
    bad = runs["bad"].result()
    assert bad.returncode == 2 and "SLIME_SCRIPT_MAX_TOKENS_PER_GPU=8k: expected a token count" in bad.stderr

    # recompute: upstream's full by default; selective with R3 (whose routes a backward's recompute would miss,
    # which the parser refuses); the user's own choice alone when the extra arguments make one
    def recompute(args: list[str]) -> list[str]:
        return [a for a in args if a.startswith("--recompute")]

    assert recompute(one) == ["--recompute-granularity", "--recompute-method", "--recompute-num-layers"]
    r3 = argv("r3")
    assert recompute(r3) == ["--recompute-granularity"] and r3[r3.index("--recompute-granularity") + 1] == "selective"
    assert parse_args(r3[3:]).train.use_rollout_routing_replay
    mine = argv("mine")
    assert recompute(mine) == ["--recompute-granularity"]
    parse_args(mine[3:])
    # SLIME_SCRIPT_RECOMPUTE: none drops it (megatron-core's default: no recompute), selective, or full even with R3,
    # which the parser then refuses naming the flag; with --recompute-granularity too, or a value it does not
    # take, the launcher stops naming the variable
    assert recompute(argv("none")) == [] and not parse_args(argv("none")[3:]).megatron.recompute_granularity
    assert parse_args(argv("sel")[3:]).megatron.recompute_granularity == "selective"
    with pytest.raises(SystemExit):
        parse_args(argv("r3_full")[3:])
    assert "--recompute-granularity full" in capsys.readouterr().err
    for name, message in (("both", "SLIME_SCRIPT_RECOMPUTE=none and --recompute-granularity full both choose"),
                          ("bad_rc", "SLIME_SCRIPT_RECOMPUTE=off: expected full, selective or none"),
                          ("fsdp_sel", "SLIME_SCRIPT_RECOMPUTE=selective: the fsdp trainer recomputes full layers or none")):
        result = runs[name].result()
        assert result.returncode == 2 and message in result.stderr, (name, result.stderr[-2000:])
    assert "--gradient-checkpointing" in argv("fsdp") and "--gradient-checkpointing" not in argv("fsdp_none")


@pytest.mark.slow
def test_gpu_default_skips_the_old_log_prob_pass_where_a_rollout_step_is_one_optimizer_step(tiny_ckpt, tmp_path,
                                                                                          capsys):
    """``--skip-actor-forward-only`` is in the GPU recipe's command unless an extra argument needs the pass (R2
    alone, ``--use-rollout-logprobs``, more than one optimizer step a rollout step, ``--kl-coef`` with
    ``--normalize-advantages``), which one line names (not with ``--check-only``); R3 and ``--kl-coef`` alone keep
    it.  SLIME_SCRIPT_SKIP_ACTOR_FORWARD=0 drops it, =1 passes it whatever the parser then says; the user's own flag
    is not repeated.  The parser accepts the commands that skip and refuses the flag where the launcher left it out."""
    skip = "--skip-actor-forward-only"
    cases = {  # name: extra arguments, variables, whether the command skips the pass
        "default": ((), {}, True),
        "r2": (("--use-routing-replay",), {}, False),
        "rollout_logprobs": (("--use-rollout-logprobs",), {}, False),
        "two_steps": (("--global-batch-size", "256"), {}, False),
        "kl_whitened": (("--kl-coef", "0.1", "--normalize-advantages"), {}, False),
        "r3": (("--use-rollout-routing-replay",), {}, True),
        "kl": (("--kl-coef", "0.1"), {}, True),
        "mine": ((skip,), {}, True),
        "never": ((), {"SLIME_SCRIPT_SKIP_ACTOR_FORWARD": "0"}, False),
        "always": (("--global-batch-size", "256"), {"SLIME_SCRIPT_SKIP_ACTOR_FORWARD": "1"}, True),
        "check_only": (("--use-routing-replay", "--check-only"), {}, False),  # dry run: printed before the check
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        runs = {name: pool.submit(_gpu_dry_run, tmp_path, 1, tiny_ckpt, args, **extra)
                for name, (args, extra, _) in cases.items()}  # fmt: skip
    notes, argvs = {}, {}
    for name, (_, _, skips) in cases.items():
        result = runs[name].result()
        assert result.returncode == 0, (name, result.stderr)
        *lines, command = result.stdout.strip().splitlines()
        argvs[name] = argv = shlex.split(command)
        assert argv.count(skip) == int(skips), (name, argv)
        notes[name] = [line for line in lines if line.startswith("[geo3k] the old-log-prob pass stays")]
    assert notes["r2"] == ["[geo3k] the old-log-prob pass stays (no --skip-actor-forward-only): --use-routing-replay "
                           "without --use-rollout-routing-replay replays the routes the pass records."]
    assert "--rollout-batch-size 64 x --n-samples-per-prompt 8" in notes["two_steps"][0]
    for name in ("rollout_logprobs", "kl_whitened"):
        assert len(notes[name]) == 1, name
    for name in ("default", "r3", "kl", "mine", "never", "always", "check_only"):
        assert notes[name] == [], name
    for name in ("default", "r3", "kl"):
        assert parse_args(argvs[name][3:]).train.skip_actor_forward_only, name
    for name in ("r2", "rollout_logprobs", "two_steps", "kl_whitened", "always"):
        argv = argvs[name][3:]
        with pytest.raises(SystemExit):
            parse_args(argv if skip in argv else [*argv, skip])
        assert "slime: error: --skip-actor-forward-only" in capsys.readouterr().err, name


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_dry_run_output_dir_moves_the_run_and_its_default_checkpoints(tiny_ckpt, tmp_path, form):
    mine = tmp_path / "mine"
    extra = ["--output-dir", str(mine)] if form == "separate" else [f"--output-dir={mine}"]
    result = subprocess.run(
        ["bash", str(LAUNCHER), *extra],
        cwd=REPO, env=_env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    cfg = parse_args(shlex.split(result.stdout.strip().splitlines()[-1])[3:])
    assert Path(cfg.logging.output_dir) == mine and Path(cfg.checkpoint.save) == mine / "checkpoints"


def test_dry_run_num_epoch_replaces_the_default_num_rollout_and_save_moves_checkpoints(tiny_ckpt, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(
        ["bash", str(LAUNCHER), "--num-epoch", "2", "--save", str(tmp_path / "ckpts")],
        cwd=REPO, env=_env(out, SLIME_SCRIPT_DRY_RUN="1"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert "--num-rollout" not in argv
    cfg = parse_args(argv[3:])  # would raise "--num-rollout and --num-epoch both given"
    assert cfg.rollout.num_epoch == 2 and cfg.rollout.num_rollout is None
    assert cfg.checkpoint.save == str(tmp_path / "ckpts")
    assert argv.count(str(tmp_path / "ckpts")) == 2  # the script's --save now agrees with ours


@pytest.mark.slow
def test_sigterm_stops_the_run_and_nothing_else(tmp_path):
    out, log = tmp_path / "run", tmp_path / "launcher.log"
    # Unrelated processes named like Ray's, in sessions of their own.
    decoys = [
        subprocess.Popen(["bash", "-c", f"exec -a {shlex.quote(name)} sleep 600"], start_new_session=True)
        for name in ("raylet", "gcs_server", "ray::IDLE", "python -m slime.train")
    ]
    small = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
             "--rollout-max-response-len", "8", "--skip-eval-before-train", "--num-rollout", "50"]  # fmt: skip
    launcher = _start(small, _env(out), log)
    driver = None
    try:
        driver = wait_for(lambda: _driver_of(launcher), RUN_TIMEOUT_S, "the driver to start", launcher)
        wait_for(lambda: read_metrics(out / "metrics.jsonl"), RUN_TIMEOUT_S, "the first rollout step", launcher)
        run = session_members(driver.sid)
        assert {"gcs_server", "raylet"} <= {p.comm for p in run}, [str(p) for p in run]
        assert any(p.comm.startswith("ray::TrainerAct") for p in run), [str(p) for p in run]

        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 128 + signal.SIGTERM, _tail(log)
        # The launcher returns only once everything it started is gone.
        survivors = session_members(driver.sid)
        assert not survivors, "processes of the stopped run survived:\n" + "\n".join(map(str, survivors))
        assert all(decoy.poll() is None for decoy in decoys), "the launcher killed an unrelated process"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if driver is not None:
            kill_session(driver.sid)
        for decoy in decoys:
            decoy.kill()
            decoy.wait()


def _folder_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: relative path -> (size, mtime in ns)."""
    return {
        str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(root.rglob("*")) if path.is_file()
    }  # fmt: skip


STOP_AFTER_LAUNCHER_DEATH_S = 60  # the driver notices at once (pidfd); Ray's shutdown takes seconds


@pytest.mark.slow
def test_sigkill_of_the_launcher_stops_the_run_and_its_checkpoint_writes(tmp_path):
    out, save, log = tmp_path / "run", tmp_path / "ckpts", tmp_path / "launcher.log"
    small = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
             "--rollout-max-response-len", "8", "--skip-eval-before-train", "--num-rollout", "50",
             "--save-interval", "2", "--save", str(save)]  # fmt: skip
    launcher = _start(small, _env(out), log)
    driver = None
    try:
        driver = wait_for(lambda: _driver_of(launcher), RUN_TIMEOUT_S, "the driver to start", launcher)
        assert f"--parent-pid {launcher.pid}" in driver.cmdline
        wait_for(lambda: (save / ckpt.LATEST_FILE).exists(), RUN_TIMEOUT_S, "the first checkpoint", launcher)
        run = session_members(driver.sid)
        assert {"gcs_server", "raylet"} <= {p.comm for p in run}, [str(p) for p in run]
        assert any(p.comm.startswith("ray::TrainerAct") for p in run), [str(p) for p in run]

        before = _folder_state(save)  # the next save is two rollout steps away
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group only: the driver has its own session
        launcher.wait()
        killed_at = time.monotonic()
        survivors = wait_session_gone(driver.sid, STOP_AFTER_LAUNCHER_DEATH_S)
        assert not survivors, "processes of the run outlived its launcher:\n" + "\n".join(map(str, survivors))
        took = time.monotonic() - killed_at
        assert _folder_state(save) == before, "the checkpoint folder was written after the launcher's SIGKILL"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if driver is not None:
            kill_session(driver.sid)
    text = log.read_text()  # the driver kept the launcher's stdout
    assert f"the launcher (pid {launcher.pid}, --parent-pid) has exited: stopping this run" in text, text[-3000:]
    assert f"slime: error: the launcher (--parent-pid {launcher.pid}) exited" in text
    print(f"run gone {took:.1f} s after the launcher's SIGKILL")


def test_printed_resume_line_reproduces_the_folders_with_a_custom_save(tiny_ckpt, tmp_path):
    out, save = tmp_path / "run", tmp_path / "my ckpts"
    # A stand-in driver that stops with status 1 (after its first step): only the printed lines matter here.
    result = subprocess.run(["bash", str(LAUNCHER), "--save", str(save), "--lr", "2e-6", "--num-rollout", "1"],
                            cwd=REPO, env=_fake_driver_env(tmp_path, out, 1), capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (resume,) = re.findall(r"^\[geo3k\] the run stopped \(exit 1\); resume it with: (.*)$", result.stdout, re.M)
    words = shlex.split(resume)
    assert words[-2:] == ["--load", str(save)] and "--overwrite-output-dir" not in words
    # Run the printed line as a user would (dry run: print the command), from another folder.
    env = {k: v for k, v in _env(tmp_path / "elsewhere").items() if k != "SLIME_SCRIPT_OUTPUT_DIR"}
    result = subprocess.run(["bash", "-c", "SLIME_SCRIPT_DRY_RUN=1 " + resume], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    cfg = parse_args(argv[3:])
    assert Path(cfg.logging.output_dir) == out
    assert cfg.checkpoint.save == str(save) and cfg.checkpoint.load == str(save)
    assert cfg.optimizer.lr == 2e-6 and cfg.rollout.num_rollout == 1


def test_a_used_run_directory_is_refused_before_anything_is_written(tiny_ckpt, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "command.sh").write_text("the first run's command\n")
    result = subprocess.run(["bash", str(LAUNCHER), "--num-rollout", "2"], cwd=REPO, env=_env(out),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2  # as the driver's own refusal: nothing ran
    assert f"slime: error: --output-dir {out} already holds the metrics of a run" in result.stderr
    assert (out / "command.sh").read_text() == "the first run's command\n"  # not overwritten


RACE_SHIM = """#!/usr/bin/env bash
# python, except that the launcher's folder probe always passes: as when another launcher takes
# the folder between this one's probe and its driver's lock.
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "slime.utils.run_lock" ]; then exit 0; fi
exec %s "$@"
"""

HOLDER = """
import sys
from slime.utils.run_lock import claim_run_dirs
claim = claim_run_dirs(sys.argv[1], sys.argv[2], None, command=["the", "first", "run"])
print("locked", flush=True)
sys.stdin.read()
"""


def test_the_loser_of_a_start_race_leaves_the_live_runs_folder_alone(tiny_ckpt, tmp_path):
    out, log = tmp_path / "run", tmp_path / "launcher.log"
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python").write_text(RACE_SHIM % shlex.quote(sys.executable))
    (shim / "python").chmod(0o755)
    env = _env(out)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(out / "checkpoints")], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        (out / "command.sh").write_text("the first run's command\n")
        env["PATH"] = os.pathsep.join([str(shim), env["PATH"]])
        launcher = _start(["--num-rollout", "2"], env, log)
        assert launcher.wait(timeout=RUN_TIMEOUT_S) == 2, _tail(log)
    finally:
        holder.kill()
        holder.wait()
    text = log.read_text()
    assert f"slime: error: --output-dir {out} is in use by another slime run (pid {holder.pid}" in text
    assert "[geo3k] the run did not start (exit 2; the error is above): nothing to resume" in text
    assert "resume it with" not in text
    assert (out / "command.sh").read_text() == "the first run's command\n"  # only the lock holder writes it


def test_relative_paths_are_taken_from_where_the_launcher_is_run(tiny_ckpt, tmp_path):
    data = tmp_path / "mydata"
    data.mkdir()
    for name in ("train.parquet", "test.parquet"):
        (data / name).symlink_to(DATA_DIR / name)
    env = {**_env(tmp_path / "unused", SLIME_SCRIPT_DRY_RUN="1", SLIME_SCRIPT_DATASET_NAME="mydata"),
           "SLIME_SCRIPT_OUTPUT_DIR": "envout"}
    hf = os.path.relpath(tiny_ckpt, tmp_path)
    flags = ["--save", "ck", "--load=./ck", "--hf-checkpoint", hf, "--prompt-data", "mydata@train",
             "--eval-prompt-data", "a", "mydata/test.parquet", "b", "hub/name", "--save-debug-rollout-data",
             "dumps/r_{rollout_id}.jsonl", "--lr", "2e-6"]  # fmt: skip
    result = subprocess.run(["bash", str(LAUNCHER), *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    cfg = parse_args(argv[3:])
    assert cfg.logging.output_dir == str(tmp_path / "envout")
    assert cfg.checkpoint.save == cfg.checkpoint.load == str(tmp_path / "ck")
    assert Path(cfg.checkpoint.hf_checkpoint).resolve() == Path(tiny_ckpt).resolve()
    assert Path(cfg.checkpoint.hf_checkpoint).is_absolute()
    assert cfg.data.prompt_data == f"{data}@train"
    assert cfg.eval.eval_prompt_data == ["a", str(data / "test.parquet"), "b", "hub/name"]  # a hub name stays
    assert cfg.run_mode.save_debug_rollout_data == str(tmp_path / "dumps" / "r_{rollout_id}.jsonl")
    i = argv.index("--prompt-data")  # the script's own data flags, from SLIME_SCRIPT_DATASET_NAME
    assert argv[i + 1] == str(data)
    assert ["--eval-prompt-data", "geo3k", str(data / "test.parquet")] == argv[argv.index("geo3k") - 1:][:3]
    assert not (tmp_path / "envout").exists() and not (tmp_path / "ck").exists()


def test_relative_debug_rollout_and_save_hf_paths_are_taken_from_where_the_launcher_is_run(tiny_ckpt, tmp_path):
    """--load-debug-rollout-data and --save-hf name files or folders too (both forms); import paths
    (--custom-rm-path) stay as given."""
    for form in ("separate", "equals"):
        pairs = [("--load-debug-rollout-data", "dumps"), ("--save-hf", "hf/{rollout_id}"),
                 ("--custom-rm-path", "mypkg.rm:score")]  # fmt: skip
        flags = [w for f, v in pairs for w in ((f, v) if form == "separate" else (f"{f}={v}",))]
        result = subprocess.run(["bash", str(LAUNCHER), *flags], cwd=tmp_path, capture_output=True, text=True,
                                env=_env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1"), timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr
        argv = shlex.split(result.stdout.strip().splitlines()[-1])
        tail = argv[-len(flags):]
        if form == "separate":
            assert tail == ["--load-debug-rollout-data", str(tmp_path / "dumps"), "--save-hf",
                            str(tmp_path / "hf" / "{rollout_id}"), "--custom-rm-path", "mypkg.rm:score"]  # fmt: skip
        else:
            assert tail == [f"--load-debug-rollout-data={tmp_path / 'dumps'}",
                            f"--save-hf={tmp_path / 'hf' / '{rollout_id}'}", "--custom-rm-path=mypkg.rm:score"]  # fmt: skip


@pytest.mark.parametrize("var", ["SLIME_SCRIPT_DRY_RUN", "SLIME_SCRIPT_EXTERNAL_RAY", "SLIME_SCRIPT_FORCE_CPU",
                                 "SLIME_SKIP_SETUP"])  # fmt: skip
@pytest.mark.parametrize("value", ["true", "false", "yes", "2"])
def test_a_switch_other_than_0_or_1_is_refused(tmp_path, var, value):
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1")
    env[var] = value
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.endswith(f"{var}={value}: expected 0 or 1 (or empty/unset, meaning 0)"), line


@pytest.mark.parametrize("var, value, expected", [
    ("SLIME_SCRIPT_NUM_GPUS", "abc", "a GPU count >= 1"), ("SLIME_SCRIPT_NUM_GPUS", "0", "a GPU count >= 1"),
    ("SLIME_SCRIPT_NUM_GPUS", "2.5", "a GPU count >= 1"),
    ("SLIME_SCRIPT_MAX_TOKENS_PER_GPU", "abc", "a token count (0: one sample per micro-batch)"),
    ("SLIME_SCRIPT_MAX_TOKENS_PER_GPU", "-1", "a token count (0: one sample per micro-batch)"),
])  # fmt: skip
def test_a_bad_count_is_refused_naming_the_variable_on_the_cpu_default_too(tmp_path, var, value, expected):
    # The CPU default (SLIME_SCRIPT_FORCE_CPU=1 in _env): NUM_GPUS was refused under the driver's flag
    # (--actor-num-gpus-per-node), MAX_TOKENS_PER_GPU (unused on the CPU) not at all.
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", **{var: value})
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == f"[geo3k] {var}={value}: expected {expected}"
    assert "slime.train" not in result.stdout


@pytest.mark.parametrize("gpus", ["3", "03"])  # 03: read as 3 (bash arithmetic reads 08 as bad octal, 010 as 8)
def test_good_counts_pass_on_the_cpu_default(tiny_ckpt, tmp_path, gpus):
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", SLIME_SCRIPT_NUM_GPUS=gpus,
               SLIME_SCRIPT_MAX_TOKENS_PER_GPU="0")  # fmt: skip
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv[argv.index("--actor-num-gpus-per-node") + 1] == "3"


@pytest.mark.parametrize("value", ["yes", "auto", "2"])
def test_a_skip_actor_forward_other_than_0_1_or_empty_is_refused_on_the_cpu_default_too(tmp_path, value):
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", SLIME_SCRIPT_SKIP_ACTOR_FORWARD=value)
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == f"[geo3k] SLIME_SCRIPT_SKIP_ACTOR_FORWARD={value}: expected 0, 1 or empty/unset (auto)"
    assert "slime.train" not in result.stdout



@pytest.mark.parametrize("value", ["", "0", "1"])
def test_skip_actor_forward_1_asks_for_the_flag_on_the_cpu_default_too(tiny_ckpt, tmp_path, value, capsys):
    """The CPU default keeps the pass (its 4 x 4 samples are two optimizer steps of 8) unless the variable is 1: then
    the flag is in the command, and the parser refuses it naming the batch sizes (not silently ignored)."""
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", SLIME_SCRIPT_SKIP_ACTOR_FORWARD=value)  # the CPU default
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv.count("--skip-actor-forward-only") == (value == "1"), argv
    if value == "1":
        from slime.arguments import parse_args

        with pytest.raises(SystemExit):
            parse_args(argv[3:])
        assert "slime: error: --skip-actor-forward-only needs one optimizer step per rollout step" in capsys.readouterr().err

def test_a_misspelt_variable_is_refused_naming_the_known_ones(tmp_path):
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", SLIME_SCRIPT_NUMGPUS="4")
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "SLIME_SCRIPT_NUMGPUS is not a variable of this script; it reads SLIME_SCRIPT_{DATASET_NAME,NUM_GPUS," in line
    assert "slime.train" not in result.stdout  # not run, not even printed
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["", "0", "1"])
def test_switches_accept_0_1_and_empty(tiny_ckpt, tmp_path, value):
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", SLIME_SCRIPT_EXTERNAL_RAY=value)
    env["SLIME_SCRIPT_FORCE_CPU"] = value  # "" and 0 ask torch for GPUs: none here, the CPU default all the same
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv[:3] == ["python", "-m", "slime.train"]
    assert ("--ray-address" in argv) == (value == "1")


def test_check_only_prints_the_checks_result_only(tiny_ckpt, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # a used folder: the check claims none, so not refused
    result = subprocess.run(["bash", str(LAUNCHER), "--num-rollout", "2", "--check-only"], cwd=REPO, env=_env(out),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.strip().splitlines()) == 1, result.stdout
    assert result.stdout.startswith("slime: flags OK"), result.stdout  # the check's result, and only that
    for absent in ("resume", "done. Output", "metrics:", "reward curve:", "checkpoints:", "--load"):
        assert absent not in result.stdout + result.stderr, absent
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # nothing written
    bad = subprocess.run(["bash", str(LAUNCHER), "--num-rollout", "0", "--check-only"], cwd=REPO, env=_env(out),
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "slime: error:" in bad.stderr
    assert "resume" not in bad.stdout + bad.stderr


@pytest.mark.parametrize("args", [["--help"], ["--num-rollout", "2", "-h"]])
def test_help_prints_the_variables_then_the_trainers_flags_and_nothing_else(tmp_path, args):
    out = tmp_path / "run"
    result = subprocess.run(["bash", str(LAUNCHER), *args], cwd=REPO, env=_env(out), capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    trainer_help = subprocess.run([sys.executable, "-m", "slime.train", "--help"], cwd=REPO, env=_env(out),
                                  capture_output=True, text=True, timeout=300).stdout  # fmt: skip
    assert trainer_help.startswith("usage: slime ")
    # The launcher's header (its usage and every variable it reads), then the trainer's help as the trainer prints it,
    # and nothing after: no run_lock usage, no "[geo3k] no GPU found / done / resume" line.
    header, _, rest = result.stdout.partition("usage: slime ")
    assert header.startswith("GRPO on Geometry3K") and "run_geo3k_qwen35.sh [extra trainer flags...]" in header
    launcher_text = LAUNCHER.read_text()
    for var in re.findall(r"^KNOWN_VARS=\((.*?)\)", launcher_text, re.M | re.S)[0].split():
        assert f"SLIME_SCRIPT_{var}" in header, var
    assert "usage: slime " + rest == trainer_help
    for absent in ("run_lock", "[geo3k]", "resume or extend", "--output-dir OUTPUT_DIR\n  --save SAVE"):
        assert absent not in result.stdout + result.stderr, absent
    assert not out.exists()  # nothing checked, claimed or written


FAKE_DRIVER = """#!/usr/bin/env bash
# python, except that the driver (python -m slime.train, not --check-only) only exits with $FAKE_STATUS.
if [ "${1:-}" = "-m" ] && [ "${2:-}" = "slime.train" ]; then
   case " $* " in *" --check-only "*) ;; *) exit "$FAKE_STATUS" ;; esac
fi
exec %s "$@"
"""


def _fake_driver_env(tmp_path: Path, out: Path, status: int) -> dict[str, str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "python").write_text(FAKE_DRIVER % shlex.quote(sys.executable))
    (shim / "python").chmod(0o755)
    env = _env(out, FAKE_STATUS=str(status))
    env["PATH"] = os.pathsep.join([str(shim), env["PATH"]])
    return env


def test_no_resume_line_for_a_run_that_did_not_start(tiny_ckpt, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(["bash", str(LAUNCHER), "--num-rollout", "3"], cwd=REPO, capture_output=True, text=True,
                            env=_fake_driver_env(tmp_path, out, 2), timeout=300)  # fmt: skip
    assert result.returncode == 2
    assert "nothing to resume" in result.stdout
    assert "--load" not in result.stdout and "resume it with" not in result.stdout
    assert "resume this run" not in result.stdout


def test_resume_lines_after_a_started_run_do_not_repeat_a_flag(tiny_ckpt, tmp_path):
    out, save = tmp_path / "run", tmp_path / "ck"
    args = ["--num-rollout", "3", "--save", str(save), "--lr", "2e-6", "--num-rollout=4"]
    stopped = subprocess.run(["bash", str(LAUNCHER), *args], cwd=REPO, capture_output=True, text=True,
                             env=_fake_driver_env(tmp_path, out, 1), timeout=300)  # fmt: skip
    assert stopped.returncode == 1
    (resume,) = re.findall(r"^\[geo3k\] the run stopped \(exit 1\); resume it with: (.*)$", stopped.stdout, re.M)
    words = shlex.split(resume)
    assert words[-2:] == ["--load", str(save)] and words.count("--load") == 1
    assert "--num-rollout" in words and "--num-rollout=4" in words  # the run's own length, to resume it
    done = subprocess.run(["bash", str(LAUNCHER), *args], cwd=REPO, capture_output=True, text=True,
                          env=_fake_driver_env(tmp_path, out, 0), timeout=300)  # fmt: skip
    assert done.returncode == 0
    assert f"[geo3k] done. Output: {out}" in done.stdout
    (extend,) = re.findall(r"^\[geo3k\] resume or extend \(same metrics file\): (.*)$", done.stdout, re.M)
    words = shlex.split(extend)
    assert words[-4:] == ["--load", str(save), "--num-rollout", "N"]
    assert sum(w == "--num-rollout" or w.startswith("--num-rollout=") for w in words) == 1
    assert words.count("--lr") == 1 and words.count("--save") == 1
    for text in (stopped.stdout, done.stdout):  # one resume line each: none before the run
        assert len(re.findall(r"^\[geo3k\] (?:resume|the run stopped)", text, re.M)) == 1, text


@pytest.mark.parametrize("var, value, allowed", [("SLIME_SCRIPT_TRAIN_BACKEND", "foo", "megatron or fsdp"),
                                                 ("SLIME_SCRIPT_TRAIN_BACKEND", "FSDP", "megatron or fsdp"),
                                                 ("SLIME_SCRIPT_ROLLOUT_BACKEND", "vllm", "sglang or transformers")])
def test_a_backend_variable_other_than_its_names_is_refused_naming_the_variable(tmp_path, var, value, allowed):
    """Refused by the launcher, naming the variable the user set (not the driver's flag) and its names."""
    env = _env(tmp_path / "run", SLIME_SCRIPT_DRY_RUN="1", **{var: value})
    result = subprocess.run(["bash", str(LAUNCHER)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == f"[geo3k] {var}={value}: expected {allowed}", line
    assert "slime.train" not in result.stdout and not (tmp_path / "run").exists()
