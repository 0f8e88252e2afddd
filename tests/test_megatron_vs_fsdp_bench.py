"""A CPU run of ``scripts/bench/megatron_vs_fsdp.py`` on the tiny checkpoint: the script the H200 runs for issue 9's
benchmark must get to its figures, and both backends must train the same step on the same samples (here with the
old-log-prob pass and Megatron's selective recompute, the launcher's kind of step; full recompute needs CUDA), with
new samples every step (``--fresh-lengths``) and the dispatcher named."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "megatron_vs_fsdp.py"


def _bench_module():
    """The bench script imported as a module (it is a script, not a package member), for its text functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_vs_fsdp_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.timeout(300)
def test_bench_runs_both_backends_on_the_same_step(tiny_ckpt, tmp_path):
    out = tmp_path / "bench.jsonl"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--checkpoint", str(tiny_ckpt), "--samples", "4",
         "--prompt-text", "16", "--image-grid", "1", "4", "4", "--response-min", "8", "--response-max", "32",
         "--max-tokens-per-gpu", "256", "--json", str(out), "--profile", str(tmp_path / "profile"),
         "--workdir", str(tmp_path / "work"), "--recompute", "selective", "--old-log-probs",
         "--fresh-lengths", "--moe-token-dispatcher-type", "allgather", "--vision-attention", "sdpa"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    megatron, fsdp, ratio = rows
    assert (megatron["backend"], fsdp["backend"]) == ("megatron", "fsdp")
    # the same 4 samples for both: prompts of 16 text tokens + vision start / end + 4 merged image tokens (a 4x4
    # patch grid, merged 2x2) = 22 tokens, responses of 8-32 tokens
    assert megatron["tokens"] == fsdp["tokens"] and megatron["samples"] == fsdp["samples"] == 4
    assert 4 * (22 + 8) <= megatron["tokens"] <= 4 * (22 + 32)
    # --fresh-lengths: the two timed steps (seeds 1 and 2) train other samples than the first step's (seed 0, whose
    # tokens the script prints), the same for both backends; the row's tokens are their mean
    first = int(re.search(r"step: 4 samples, (\d+) tokens", done.stdout).group(1))
    assert megatron["step_tokens"] == fsdp["step_tokens"] and len(megatron["step_tokens"]) == 2
    assert len({first, *megatron["step_tokens"]}) == 3 and megatron["fresh_lengths"]
    assert megatron["tokens"] == round(sum(megatron["step_tokens"]) / 2) and megatron["dispatcher"] == "allgather"
    # the launcher's compute: the old-log-prob forward first (timed in its own sub-phase), Megatron recomputing
    assert megatron["old_log_probs"] and megatron["recompute"] == "selective" and megatron["max_tokens_per_gpu"] == 256
    assert 0 < megatron["old_log_probs_s"] < megatron["step_s"] and 0 < fsdp["old_log_probs_s"] < fsdp["step_s"]
    # --vision-attention sdpa found the Megatron model's one vision tower (the FSDP model's HF tower is SDPA anyway)
    assert "megatron: vision attention sdpa in 1 tower(s)" in done.stdout and megatron["vision_attention"] == "sdpa"
    assert megatron["micro_batches"] == 1  # packed: every sample in one micro-batch of <= 256 tokens
    # the Megatron backend's per-micro-batch clock; one micro-batch: the first is the median and the max
    clock = megatron["micro_batch"]
    assert clock["first_s"] == clock["median_s"] == clock["max_s"] > 0 and fsdp["micro_batch"] == {}, (clock, fsdp)
    # the same checkpoint, samples and GRPO loss: both backends' first step has the same loss (fp32 on CPU)
    assert megatron["loss"] == pytest.approx(fsdp["loss"], rel=1e-5)
    # the ratios are those of the two rows
    assert ratio["megatron_over_fsdp"]["speedup"] == round(fsdp["step_s"] / megatron["step_s"], 2)
    assert ratio["megatron_over_fsdp"]["tokens_per_s"] == round(megatron["tokens_per_s"] / fsdp["tokens_per_s"], 2)
    assert {p.name for p in (tmp_path / "profile").iterdir()} == {"megatron.txt", "fsdp.txt"}
    # the profiled step's operators by the line that called them: megatron-core's or the project's frames
    sites = (tmp_path / "profile" / "megatron.txt").read_text().partition("by call site")[2]
    assert re.search(r"^\s+(slime|megatron)/\S+\.py\(\d+\): \w+", sites, flags=re.M), sites[:2000]


def test_the_cuda_profile_splits_the_kernels_device_time_by_kind_without_the_launch_queue_wait():
    bench = _bench_module()

    def event(key, cpu_us, device_us):
        return types.SimpleNamespace(key=key, cpu_time_total=cpu_us, self_device_time_total=device_us)

    class Averages(list):  # torch's EventList: the events, and a table of them
        def table(self, sort_by, row_limit):
            return "\n".join([f"sorted by {sort_by}", *(f"  {e.key}  {e.self_device_time_total}" for e in self)])

    averages = Averages([
        event("Command Buffer Full", 32_000, 5_000_000),  # the CPU's wait (a CPU event with booked device time)
        event("aten::mm", 900, 700_000),  # an operator: CPU time; its kernels are counted below
        event("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 400_000),
        event("cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", 0, 150_000),
        event("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", 0, 150_000),
        event("chunk_gated_delta_rule_fwd_kernel_h", 0, 200_000),
        event("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", 0, 100_000),
        event("void at::native::vectorized_elementwise_kernel<4, clamp_max_scalar_kernel>", 0, 100_000),
        event("void at::native::reduce_kernel<512, 1, ReduceOp<float, NormTwoOps>>", 0, 100_000),
        event("some_unknown_kernel", 0, 0),  # no device time: left out
    ])
    text = bench.profile_text(averages, cuda=True)
    table, _, rest = text.partition("kernels alone:")
    assert table.startswith("sorted by self_cuda_time_total") and "aten::mm" in table
    assert "Command Buffer Full" not in text
    assert rest.startswith(" 1200.0 ms of device time")
    shares = dict(re.findall(r"^(\S[\w /]*?)\s+[\d.]+ ms\s+([\d.]+)%$", rest, flags=re.M))
    assert shares == {"matrix products": "33.3", "attention": "25.0", "Gated DeltaNet / Triton": "16.7",
                      "copies": "8.3", "elementwise": "8.3", "reductions and norms": "8.3"}
    assert bench.profile_text(Averages(averages[:2]), cuda=True).count("kernels alone: 0.0 ms") == 1  # no kernel recorded
    assert bench.profile_text(averages, cuda=False).splitlines()[0] == "sorted by self_cpu_time_total"


def test_the_call_site_table_names_the_python_line_that_launched_the_device_time():
    bench = _bench_module()

    def event(name, device_us=0, parent=None):
        return types.SimpleNamespace(name=name, self_device_time_total=device_us, self_cpu_time_total=10,
                                     cpu_parent=parent)

    step = event("/x/slime/backends/step.py(40): train_step")
    hook = event("/x/megatron/core/distributed/param_and_grad_buffer.py(120): hook",
                 parent=event("/usr/lib/torch/profiler/profiler.py(700): __enter__", parent=step))  # not printed
    fwd = event("/x/slime/models/qwen3_5/gdn.py(206): forward", device_us=5, parent=step)  # a Python event: skipped
    events = [step, hook, fwd,
              *(event("aten::add_", 100_000, parent=hook) for _ in range(3)),  # one group: 300 ms, 3 calls
              event("aten::add_", 50_000, parent=fwd),  # the same operator from another line: its own group
              event("aten::mul", 200_000),  # autograd's thread: no Python frame
              event("Command Buffer Full", 5_000_000), event("aten::zero_", 0, parent=step)]
    text = bench.call_site_text(events, cuda=True, limit=3)
    rows = text.strip().splitlines()
    assert rows[0].startswith("by call site")
    assert "Command Buffer Full" not in text and "aten::zero_" not in text  # the wait and an operator with no time
    assert rows[1].split()[:4] == ["300.0", "ms", "3x", "aten::add_"]  # most time first, calls summed
    assert [r.strip() for r in rows[2:4]] == ["/x/megatron/core/distributed/param_and_grad_buffer.py(120): hook",
                                              "/x/slime/backends/step.py(40): train_step"]
    assert rows[4].split()[:4] == ["200.0", "ms", "1x", "aten::mul"] and rows[5].strip() == "(no Python frame)"
    assert rows[6].split()[:4] == ["50.0", "ms", "1x", "aten::add_"]
    assert [r.strip() for r in rows[7:]] == ["/x/slime/models/qwen3_5/gdn.py(206): forward",
                                             "/x/slime/backends/step.py(40): train_step"]
