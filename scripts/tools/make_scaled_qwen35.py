#!/usr/bin/env python
"""Build the real-width scaled Qwen3.5-35B-A3B checkpoint (see slime/checkpoints/scaled_qwen35.py).

  python scripts/tools/make_scaled_qwen35.py                 # cached under .cache/scaled-qwen35/, prints the path
  python scripts/tools/make_scaled_qwen35.py DIR [--force]   # into DIR
  python scripts/tools/make_scaled_qwen35.py --layers 4 --experts 8 --no-mtp --device cpu

The last line printed is the folder; the line before it, a JSON line of figures (parameters of the model and of its
MTP layer from the safetensors headers, seconds, device).  Use the folder with
SLIME_SCRIPT_MODEL_NAME=Qwen3.5-35B-A3B-scaled SLIME_SCRIPT_HF_CHECKPOINT=<folder> (4 layers, 128 experts only).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slime.checkpoints.mtp import MTP_PREFIX, safetensors_header  # noqa: E402
from slime.checkpoints.scaled_qwen35 import (  # noqa: E402
    EXPERTS,
    LAYERS,
    build_scaled_checkpoint,
    default_device,
    ensure_scaled_checkpoint,
)


def parameter_counts(folder: Path) -> tuple[int, int]:
    """(parameters of the model, parameters of its MTP layer) of a checkpoint folder, from its safetensors headers."""
    model = mtp = 0
    for path in sorted(folder.glob("*.safetensors")):
        for name, entry in safetensors_header(path).items():
            count = math.prod(entry["shape"])
            if name.startswith(MTP_PREFIX):
                mtp += count
            else:
                model += count
    return model, mtp


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=None,
                        help="destination folder; default: a folder under .cache/scaled-qwen35/ (reused if built)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (every 4th full attention)")
    parser.add_argument("--experts", type=int, default=EXPERTS, help="routed experts per layer (top-8)")
    parser.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True,
                        help="add one random MTP layer of the released shapes (SGLang's speculative decoding)")
    parser.add_argument("--device", default=None, help="where the weights are drawn (default: cuda if visible)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the weights")
    args = parser.parse_args(argv)
    device = args.device or default_device()
    started = time.monotonic()
    try:
        if args.out is None:
            path = ensure_scaled_checkpoint(layers=args.layers, experts=args.experts, mtp=args.mtp, device=device,
                                            seed=args.seed)
        else:
            out = args.out
            if out.exists() and any(out.iterdir()) and not args.force:
                parser.error(f"{out} exists and is not empty; pass --force to replace it")
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            try:
                build_scaled_checkpoint(tmp, args.layers, args.experts, args.mtp, device=device, seed=args.seed)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            path = out
    except ValueError as e:
        parser.error(str(e))
    params, mtp_params = parameter_counts(path)
    print(json.dumps({"check": "scaled_model", "params": params, "mtp_params": mtp_params, "layers": args.layers,
                      "experts": args.experts, "device": device, "seconds": round(time.monotonic() - started, 1)}))
    print(path, flush=True)
    return path


if __name__ == "__main__":
    main()
