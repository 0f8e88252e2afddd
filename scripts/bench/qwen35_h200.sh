#!/usr/bin/env bash
# The H200 runs of the native Qwen3.5 model's acceptance (issue 8): GPU parity tests, then the speed benchmark.
#   bash scripts/bench/qwen35_h200.sh OUT_DIR BUNDLE_DIR
# BUNDLE_DIR: a wheel bundle made on a CPU machine with ../shared/gpu/build_bundle.sh (site.sha256 and
# p*/site.tar.xz.part-*) of the packages the GPU image lacks (Python 3.12, torch 2.11.0+cu130):
#   megatron-core==0.16.1 fla-core==0.6.0 flash-linear-attention==0.6.0 tilelang==0.1.15
#   apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0
# Logs and figures go to OUT_DIR (probe.log, pytest_main.log, bench.log, bench.jsonl, figures.jsonl,
# pytest_fp32_fla.log).  fla's first forward+backward compiles its Triton/tilelang kernels (minutes).
set -uo pipefail
cd "$(dirname -- "${BASH_SOURCE[0]}")/../.."
OUT=${1:?usage: qwen35_h200.sh OUT_DIR BUNDLE_DIR}; BUNDLE=${2:?usage: qwen35_h200.sh OUT_DIR BUNDLE_DIR}
mkdir -p "$OUT" /tmp/site
if [ ! -f /tmp/site/.done ]; then
  cat "$BUNDLE"/p*/site.tar.xz.part-* > /tmp/site.tar.xz
  echo "$(cat "$BUNDLE/site.sha256")  /tmp/site.tar.xz" | sha256sum -c --quiet || { echo "bundle parts incomplete"; exit 3; }
  xz -dc -T0 /tmp/site.tar.xz | tar -C /tmp/site -xf - && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True SLIME_GPU_FIGURES=$OUT/figures.jsonl
python3 - <<'PY' 2>&1 | tee "$OUT/probe.log"
import inspect, torch, megatron.core, fla
print("torch", torch.__version__, "megatron-core", megatron.core.__version__, "fla", fla.__version__, torch.cuda.get_device_name())
from torch.nn.attention.varlen import varlen_attn
print("varlen_attn", inspect.signature(varlen_attn))
a, b = torch.randn(64, 128, device="cuda"), torch.randn(2, 128, 64, device="cuda")
out = torch._grouped_mm(a, b, offs=torch.tensor([32, 64], dtype=torch.int32, device="cuda"))
print("grouped_mm fp32 max err", (out[32:] - a[32:] @ b[1]).abs().max().item())
PY
python3 -m pytest -s -rA -p no:cacheprovider tests/test_qwen35_gpu.py -k "not fp32_fla" 2>&1 | tee "$OUT/pytest_main.log"
python3 scripts/bench/qwen35_native_vs_hf.py --tokens 4096 16384 --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
python3 -m pytest -s -rA -p no:cacheprovider tests/test_qwen35_gpu.py -k fp32_fla 2>&1 | tee "$OUT/pytest_fp32_fla.log"
