"""The colour task (``scripts/harness/colour_task.py``) on a real-width checkpoint: its data and a colour-prior copy of the
checkpoint, for the learning run of the production pair at real width (``h200_real_width.sh learn``).

    python scripts/bench/colour_prior.py --model SCALED_DIR --out DIR [--temperature 0.5] [--target 0.9]

Writes ``DIR/colours.parquet`` (2 rows per colour; answers ``r`` / ``g`` / ``b``, one byte-level BPE token each) and
``DIR/checkpoint`` (hard links to ``--model``'s files, but the shard holding ``lm_head.weight``), and prints one JSON
line.  The prior is ``tests/test_learning.py``'s, sized for a 248,320-token vocabulary: row ``a`` of ``lm_head`` for
each answer token becomes ``W[a] + B h_mean / |h_mean|^2`` (``h_mean``: the mean final hidden state at the answer
position of the three prompts, built by slime's data pipeline with the run's flags), which raises the three answers'
logits by the same ``B (h . h_mean) / |h_mean|^2`` in a given context.  ``B`` is the smallest multiple of 0.25 nats
at which, at ``--temperature``, the three answers hold at least ``--target`` of the probability on every prompt: the
policy starts by naming a colour (reward about 1/3, as a text-only policy at best) and has to learn which from the
pixels.  The random model's own logits (std about 0.9 over 248,320 tokens) need ``B`` near 7-10 nats here, against
3 for the tiny word-level checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.harness.colour_task import COLOURS, SINGLE_LETTER_ANSWERS, write_colour_dataset  # noqa: E402

ROWS_PER_COLOUR = 2
"""Rows of each colour in ``DIR/colours.parquet``: 6 rows, one rollout of the learning run (``--rollout-batch-size
6``) and every prompt the engine parity check may probe (``--engine-parity-prompts`` at most 6)."""

FLAGS = ["--input-key", "problem", "--label-key", "answer", "--multimodal-keys", '{"image": "images"}',
         "--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}',
         "--rollout-batch-size", "6", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "1",
         "--num-rollout", "1", "--colocate"]
"""The data flags of the learning run (the launcher adds the first five; the run passes the others)."""


def answer_token_ids(tokenizer) -> list[int]:
    """The one token of each colour's answer word; ``ValueError`` naming a word the tokenizer splits."""
    ids = []
    for colour, word in SINGLE_LETTER_ANSWERS.items():
        pieces = tokenizer.encode(word, add_special_tokens=False)
        if len(pieces) != 1:
            raise ValueError(f"answer {word!r} of {colour} is {len(pieces)} tokens {pieces} in this tokenizer; the task "
                             "needs one token per answer (--rollout-max-response-len 1)")
        ids.append(pieces[0])
    return ids


def smallest_boost(logits: torch.Tensor, lift: torch.Tensor, answer_ids: list[int], temperature: float,
                   target: float, step: float = 0.25, limit: float = 40.0) -> tuple[float, list[float]]:
    """The smallest ``B`` in ``0, step, 2 step, ... limit`` at which ``softmax((logits + B lift on answer_ids) / T)``
    gives the answers together at least ``target`` on every row; returns ``(B, that share per row)``.

    Args:
        logits: float32 ``[P, V]``, the model's logits at the answer position of ``P`` prompts.
        lift: float32 ``[P]``, ``(h . h_mean) / |h_mean|^2`` per prompt (the logit rise per nat of ``B``).

    Raises:
        ValueError: no ``B`` up to ``limit`` reaches ``target``.
    """
    b = 0.0
    while b <= limit:
        boosted = logits.clone()
        boosted[:, answer_ids] += b * lift[:, None]
        share = torch.softmax(boosted / temperature, dim=-1)[:, answer_ids].sum(-1)
        if bool((share >= target).all()):
            return b, share.tolist()
        b += step
    raise ValueError(f"no boost up to {limit} nats gives the answers {target} of the probability at T={temperature}")


def link_copy(src: Path, dst: Path, replaced: set[str]) -> None:
    """``dst`` with a hard link to every file of ``src`` except ``replaced`` (a copy where links fail)."""
    dst.mkdir(parents=True, exist_ok=False)
    for path in src.iterdir():
        if path.is_file() and path.name not in replaced:
            try:
                os.link(path, dst / path.name)
            except OSError:
                (dst / path.name).write_bytes(path.read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="A Qwen3.5-MoE checkpoint folder (the scaled one).")
    parser.add_argument("--out", required=True, type=Path, help="Folder for colours.parquet and checkpoint/ (new).")
    parser.add_argument("--temperature", type=float, default=0.5, help="The run's --rollout-temperature.")
    parser.add_argument("--target", type=float, default=0.9, help="Share of the three answers at the start.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    from slime.models.qwen3_5.build import transformers_qwen35_without_fla

    # the torch path of Gated DeltaNet (exact, and on a fresh GPU machine no fla compile for the HF call shapes)
    modeling = transformers_qwen35_without_fla()
    from safetensors.torch import load_file, save_file

    from slime.arguments import parse_args
    from slime.data.dataset import PromptDataset
    from slime.data.processor import load_processor, mm_token_type_ids

    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "colours.parquet"
    write_colour_dataset(data, rows_per_colour=ROWS_PER_COLOUR, answers=SINGLE_LETTER_ANSWERS)
    processor = load_processor(args.model)
    answer_ids = answer_token_ids(processor.tokenizer)
    cfg = parse_args(["--hf-checkpoint", str(args.model), "--prompt-data", str(data), *FLAGS,
                      "--rollout-backend", "transformers", "--train-backend", "fsdp"])
    prompts = PromptDataset(cfg.data, processor, seed=0).next_batch(len(COLOURS))

    model = modeling.Qwen3_5MoeForConditionalGeneration.from_pretrained(args.model, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    hidden, logits = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p.prompt_token_ids])
            out = model(input_ids=ids.to(args.device),
                        pixel_values=p.multimodal_inputs["pixel_values"].to(args.device),
                        image_grid_thw=p.multimodal_inputs["image_grid_thw"].to(args.device),
                        mm_token_type_ids=mm_token_type_ids(ids, model.config.image_token_id).to(args.device),
                        output_hidden_states=True, logits_to_keep=1)
            hidden.append(out.hidden_states[-1][0, -1].float().cpu())
            logits.append(out.logits[0, -1].float().cpu())
    del model
    h = torch.stack(hidden)
    h_mean = h.mean(0)
    lift = h @ h_mean / h_mean.dot(h_mean)
    boost, share = smallest_boost(torch.stack(logits), lift, answer_ids, args.temperature, args.target)

    index = args.model / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["lm_head.weight"] if index.exists() else "model.safetensors"
    link_copy(args.model, args.out / "checkpoint", replaced={shard})
    tensors = load_file(args.model / shard)
    head = tensors["lm_head.weight"]  # only the answers' rows change, in the checkpoint's dtype
    head[answer_ids] = (head[answer_ids].float() + boost * h_mean / h_mean.dot(h_mean)).to(head.dtype)
    save_file(tensors, args.out / "checkpoint" / shard, metadata={"format": "pt"})
    print(json.dumps({"colour_prior": {"boost_nats": boost, "answer_share_at_start": share, "answer_ids": answer_ids,
                                       "lift": lift.tolist(), "checkpoint": str(args.out / "checkpoint"),
                                       "data": str(data)}}), flush=True)


if __name__ == "__main__":
    main()
