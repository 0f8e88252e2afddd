#!/usr/bin/env python
"""Build the tiny random Qwen3.5-MoE checkpoint (see slime/checkpoints/tiny_qwen35.py).

  python scripts/tools/make_tiny_qwen35.py                      # cached under .cache/tiny-qwen35/, prints the path
  python scripts/tools/make_tiny_qwen35.py --out /tmp/tiny --force
  python scripts/tools/make_tiny_qwen35.py --vocab-words red green blue --out /tmp/tiny-words
  python scripts/tools/make_tiny_qwen35.py --real-geometry --max-pixels 262144   # the SGLang multimodal-RoPE tests
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slime.checkpoints.tiny_qwen35 import TinyQwen35Options, build_tiny_checkpoint, ensure_tiny_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> Path:
    defaults = TinyQwen35Options()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="destination folder; default: a folder under .cache/tiny-qwen35/ (reused if built)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="torch seed of the weight initialisation")
    parser.add_argument("--vocab-words", nargs="+", default=None, metavar="WORD",
                        help="build a word-level tokenizer with these words instead of the byte-level BPE one")
    parser.add_argument("--bpe-vocab-size", type=int, default=defaults.bpe_vocab_size,
                        help="vocab size of the BPE tokenizer, added tokens included")
    parser.add_argument("--min-pixels", type=int, default=defaults.min_pixels,
                        help="image processor lower bound on an image's area, pixels")
    parser.add_argument("--max-pixels", type=int, default=defaults.max_pixels,
                        help="image processor upper bound on an image's area, pixels")
    parser.add_argument("--real-geometry", action="store_true",
                        help="Qwen3.5-35B-A3B's attention geometry (head_dim 256, 25%% interleaved M-RoPE) at "
                        "tiny width")
    args = parser.parse_args(argv)
    fields = dict(seed=args.seed, vocab_words=args.vocab_words, bpe_vocab_size=args.bpe_vocab_size,
                  min_pixels=args.min_pixels, max_pixels=args.max_pixels, real_geometry=args.real_geometry)
    try:
        options = TinyQwen35Options(**fields)
    except ValueError as e:
        parser.error(str(e))

    if args.out is None:
        path = ensure_tiny_checkpoint(**fields)
    else:
        out = args.out
        if out.exists() and any(out.iterdir()) and not args.force:
            parser.error(f"--out {out} exists and is not empty; pass --force to replace it")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            build_tiny_checkpoint(tmp, options)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        path = out
    print(path)
    return path


if __name__ == "__main__":
    main()
