"""A tiny, seeded, random-initialised Qwen3.5-MoE vision-language checkpoint for CPU tests.

Qwen3.5-35B-A3B's architecture (``Qwen3_5MoeForConditionalGeneration``) scaled down to under a million
parameters (:data:`TEXT_CONFIG`, :data:`VISION_CONFIG`), float32 safetensors, a BPE (or word-level)
tokenizer trained here on ``tiny_tokenizer_corpus.txt`` (Geometry3K problems, Lu et al., "Inter-GPS",
ACL 2021, MIT licence, plus generated sentences), the Qwen chat format and the Qwen2-VL image-processor
config.  Entry points: :func:`ensure_tiny_checkpoint` (cached; what tests use), :func:`build_tiny_checkpoint`,
``scripts/tools/make_tiny_qwen35.py``.  The recipe and its reasons: ``docs/design/tiny_qwen35.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, WordLevel
from tokenizers.trainers import BpeTrainer

BUILDER_VERSION = 3
"""Bump whenever the recipe changes (weights, configs, tokenizer): cached folders rebuild."""

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "tiny-qwen35"
CORPUS_PATH = Path(__file__).with_name("tiny_tokenizer_corpus.txt")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Control tokens, each a single id, ``special=True`` (dropped by ``skip_special_tokens``)."""

THINK_TOKENS = ("<think>", "</think>")
"""Reasoning delimiters: single ids but ``special=False``, as in Qwen3/3.5, so decoding a
response with ``skip_special_tokens=True`` keeps them (reward functions may look for them)."""

WORD_LEVEL_UNK = "<unk>"
WORD_LEVEL_BASE = ("\n", " ", "system", "user", "assistant")
"""Pieces every word-level vocabulary holds so that the chat template encodes without ``<unk>``."""

# Qwen's ChatML format, written for this project.  Generation prompt: Qwen3.5 is a thinking
# model whose released template opens the assistant turn with "<think>\n" (the model then
# writes its reasoning, "</think>", and the answer); ``enable_thinking=False`` pre-fills an
# empty reasoning block instead, as Qwen3's template does.  Both keep the token counts of
# the real model's prompts.  Content items {"type": "image"} (or with an "image" /
# "image_url" key) become one vision span, {"type": "video"} likewise; the processor later
# expands each <|image_pad|> to the image's token count.  Past assistant turns are rendered
# verbatim (no stripping of their reasoning) and tools are not supported.
CHAT_TEMPLATE = """\
{%- if tools is defined and tools %}
    {{- raise_exception('the tiny Qwen3.5 chat template does not render tools') }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for item in message['content'] %}
            {%- if item['type'] == 'image' or 'image' in item or 'image_url' in item %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif item['type'] == 'video' or 'video' in item %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item['text'] }}
            {%- else %}
                {{- raise_exception('content items must be text, image or video; got keys '
                                    + (item | list | join(', '))) }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""

TEXT_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    # Rotary dim = 32 * 0.25 = 8, i.e. 4 frequencies; mrope_section splits them over
    # (temporal, height, width) and must sum to 4 (the released [11, 11, 10] sums to 256 * 0.25 / 2 = 32).
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=8192,
    router_aux_loss_coef=0.001,
    tie_word_embeddings=False,
    attention_bias=False,
    initializer_range=0.02,
)
"""Tiny text-model numbers (``Qwen3_5MoeTextConfig`` fields; vocab and token ids come from the tokenizer)."""

REAL_GEOMETRY_TEXT_CONFIG = dict(
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    # Rotary dim = 256 * 0.25 = 64, i.e. 32 frequencies split [11, 11, 10] over (T, H, W), interleaved:
    # Qwen3.5-35B-A3B's exact rotary; image heights and widths rotate by up to ~1 rad per position.
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
    ),
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
)
"""What ``TinyQwen35Options(real_geometry=True)`` changes in :data:`TEXT_CONFIG`: Qwen3.5-35B-A3B's
attention and GDN geometry (16 query / 2 KV heads of head_dim 256, 25 % rotary, interleaved
``mrope_section`` [11, 11, 10]; 16 key / 32 value GDN heads of 128 dims) at the tiny width, depth and
expert count; the kernels then run at the real model's head shapes.  For parity tests whose
position bugs must be visible (the default's 8 rotary dims with sections [2, 1, 1] turn image
heights and widths by ~1e-3 rad)."""

FULL_ATTENTION_INTERVAL = 4
"""Every 4th layer is full attention (SGLang's ``text_config.full_attention_interval``)."""

VISION_CONFIG = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=128,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=TEXT_CONFIG["hidden_size"],
    num_position_embeddings=256,  # a 16 x 16 learned grid, bilinearly resampled to each image's grid
    hidden_act="gelu_pytorch_tanh",
    initializer_range=0.02,
    deepstack_visual_indexes=[],
)
"""Tiny vision-tower numbers (``Qwen3_5MoeVisionConfig`` fields)."""

IMAGE_MEAN_STD = [0.5, 0.5, 0.5]
"""Qwen3-VL / Qwen3.5 normalise pixels to [-1, 1]: (x / 255 - 0.5) / 0.5."""


@dataclasses.dataclass(frozen=True)
class TinyQwen35Options:
    """What a tiny checkpoint is built from; every field is part of the cache key.

    Attributes:
        seed: torch seed of the weight initialisation.
        vocab_words: ``None`` for the BPE tokenizer; else the words of a word-level tokenizer (one token
            each, no whitespace inside), the model's vocab_size matching its ids exactly.
        bpe_vocab_size: total ids of the BPE tokenizer, added tokens included.
        min_pixels, max_pixels: the image processor's pixel bounds.
        real_geometry: :data:`REAL_GEOMETRY_TEXT_CONFIG` (35B-A3B's head geometry); pair it with a
            ``max_pixels`` giving a few hundred merged tokens (one per 32 x 32 pixels).

    Raises:
        ValueError: a field is out of range; the message names it.
    """

    seed: int = 0
    vocab_words: tuple[str, ...] | None = None
    bpe_vocab_size: int = 2048
    min_pixels: int = 32 * 32
    max_pixels: int = 128 * 128
    real_geometry: bool = False

    def __post_init__(self):
        if self.vocab_words is not None:
            words = tuple(self.vocab_words)
            object.__setattr__(self, "vocab_words", words)
            reserved = set(SPECIAL_TOKENS) | set(THINK_TOKENS) | {WORD_LEVEL_UNK} | set(WORD_LEVEL_BASE)
            if not words:
                raise ValueError("vocab_words is empty; pass at least one word, or None for the BPE tokenizer")
            for i, word in enumerate(words):
                if not isinstance(word, str) or not word or any(ch.isspace() for ch in word):
                    raise ValueError(
                        f"vocab_words[{i}] = {word!r} must be a non-empty string without whitespace "
                        "(the word-level tokenizer splits on whitespace)"
                    )
                if word in reserved:
                    raise ValueError(f"vocab_words[{i}] = {word!r} is already in every word-level vocab; drop it")
                if word in words[:i]:
                    raise ValueError(f"vocab_words[{i}] = {word!r} is a duplicate; list each word once")
        n_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
        if self.bpe_vocab_size < 256 + n_added + 1:
            raise ValueError(
                f"bpe_vocab_size = {self.bpe_vocab_size} is too small: the byte alphabet (256) and "
                f"{n_added} added tokens need at least {256 + n_added + 1}"
            )
        factor = VISION_CONFIG["patch_size"] * VISION_CONFIG["spatial_merge_size"]
        if self.min_pixels < factor * factor:
            raise ValueError(
                f"min_pixels = {self.min_pixels} is below one merged patch ({factor}x{factor} = {factor * factor})"
            )
        if self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels = {self.max_pixels} is below min_pixels = {self.min_pixels}")

    def cache_name(self) -> str:
        """Folder name under the cache dir: tokenizer kind + hash of the options and BUILDER_VERSION."""
        fields = dataclasses.asdict(self)
        if not self.real_geometry:  # absent for the default recipe: its folder name predates the field
            del fields["real_geometry"]
        payload = json.dumps({"builder_version": BUILDER_VERSION, **fields}, sort_keys=True)
        digest = hashlib.sha256(payload.encode()).hexdigest()[:16]
        kind = ("bpe" if self.vocab_words is None else "words") + ("-realgeo" if self.real_geometry else "")
        return f"{kind}-seed{self.seed}-{digest}"


def build_bpe_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """A byte-level BPE tokenizer with Qwen3.5's pipeline, trained (deterministically) on the shipped corpus.

    The added tokens take the last of exactly ``vocab_size`` ids.

    Raises:
        RuntimeError: the corpus is too small to learn ``vocab_size`` ids.
    """
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_added = len(SPECIAL_TOKENS) + len(THINK_TOKENS)
    trainer = BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    lines = CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    _add_qwen_tokens(tok)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"BPE training on {CORPUS_PATH} reached {tok.get_vocab_size()} ids, not bpe_vocab_size = {vocab_size}; "
            "lower bpe_vocab_size"
        )
    return tok


def build_word_level_tokenizer(vocab_words: tuple[str, ...]) -> Tokenizer:
    """A word-level tokenizer: each of ``vocab_words`` one token, anything else ``<unk>``; round-trips its words."""
    pieces = [*SPECIAL_TOKENS, *THINK_TOKENS, WORD_LEVEL_UNK, *WORD_LEVEL_BASE, *vocab_words]
    tok = Tokenizer(WordLevel({piece: i for i, piece in enumerate(pieces)}, unk_token=WORD_LEVEL_UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    _add_qwen_tokens(tok)
    return tok


def _add_qwen_tokens(tok: Tokenizer) -> None:
    """Register the special and think tokens as added tokens (matched before pre-tokenization)."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])


def _write_tokenizer(tok: Tokenizer, out_dir: Path, word_level: bool) -> None:
    """Save through transformers (``TokenizersBackend``), so that ``AutoTokenizer`` reads exactly these files back."""
    from transformers import TokenizersBackend

    hf_tok = TokenizersBackend(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=WORD_LEVEL_UNK if word_level else None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=TEXT_CONFIG["max_position_embeddings"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out_dir)


def _write_processor_configs(out_dir: Path, min_pixels: int, max_pixels: int) -> None:
    """Write the image, video and processor configs in the layout of a released Qwen3.5 folder."""
    common = dict(
        do_convert_rgb=True,
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=IMAGE_MEAN_STD,
        image_std=IMAGE_MEAN_STD,
        resample=3,  # PIL bicubic
        patch_size=VISION_CONFIG["patch_size"],
        temporal_patch_size=VISION_CONFIG["temporal_patch_size"],
        merge_size=VISION_CONFIG["spatial_merge_size"],
        processor_class="Qwen3VLProcessor",
    )
    image = dict(
        image_processor_type="Qwen2VLImageProcessorFast",
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        **common,
    )
    video = dict(
        video_processor_type="Qwen3VLVideoProcessor",
        size={"shortest_edge": min_pixels * VISION_CONFIG["temporal_patch_size"], "longest_edge": max_pixels * 16},
        do_sample_frames=True,
        fps=2,
        min_frames=4,
        max_frames=16,
        **common,
    )
    _write_json(out_dir / "preprocessor_config.json", image)
    _write_json(out_dir / "video_preprocessor_config.json", video)
    _write_json(out_dir / "processor_config.json", {"processor_class": "Qwen3VLProcessor"})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _model_config(tok: Tokenizer, real_geometry: bool = False):
    """The ``Qwen3_5MoeConfig`` of the tiny model, with token ids read from ``tok``."""
    from transformers import Qwen3_5MoeConfig

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    base = copy.deepcopy(TEXT_CONFIG)
    if real_geometry:
        base.update(copy.deepcopy(REAL_GEOMETRY_TEXT_CONFIG))
    text = dict(
        base,
        vocab_size=tok.get_vocab_size(),
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
        dtype="float32",
    )
    config = Qwen3_5MoeConfig(
        text_config=text,
        vision_config=copy.deepcopy(VISION_CONFIG),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    # Read by SGLang (see the module docstring); transformers keeps unknown fields as attributes.
    config.text_config.full_attention_interval = FULL_ATTENTION_INTERVAL
    return config


def build_tiny_checkpoint(out_dir: str | os.PathLike, options: TinyQwen35Options | None = None) -> Path:
    """Write the tiny checkpoint folder ``out_dir`` (config, float32 safetensors, tokenizer, chat template, processor).

    Same options: bit-identical files.  Returns ``Path(out_dir)``.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    import torch  # here, not at the top: the launcher asks ensure_tiny_checkpoint for the cached folder without torch
    from transformers import GenerationConfig, Qwen3_5MoeForConditionalGeneration

    options = options or TinyQwen35Options()
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty; choose an empty folder or delete it first")
    out_dir.mkdir(parents=True, exist_ok=True)

    word_level = options.vocab_words is not None
    tok = build_word_level_tokenizer(options.vocab_words) if word_level else build_bpe_tokenizer(options.bpe_vocab_size)
    config = _model_config(tok, options.real_geometry)

    torch.manual_seed(options.seed)
    model = Qwen3_5MoeForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.text_config.eos_token_id, config.text_config.pad_token_id],
        pad_token_id=config.text_config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    _write_tokenizer(tok, out_dir, word_level)
    _write_processor_configs(out_dir, options.min_pixels, options.max_pixels)
    return out_dir


def ensure_tiny_checkpoint(cache_dir: str | os.PathLike | None = None, **options) -> Path:
    """The cached tiny checkpoint of ``options`` (fields of :class:`TinyQwen35Options`), built atomically on first use.

    Under ``cache_dir`` (default ``<repo>/.cache/tiny-qwen35``), named by the options and :data:`BUILDER_VERSION`.

    Raises:
        TypeError: an unknown option name.
        ValueError: an invalid option value.
    """
    opts = TinyQwen35Options(**options)
    cache_dir = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    return build_once(cache_dir / opts.cache_name(), lambda tmp: build_tiny_checkpoint(tmp, opts))


def build_once(final: Path, build) -> Path:
    """``final``, built by ``build(tmp)`` into a temporary sibling and renamed into place unless it exists: a reader
    never sees half a folder, and of two racing builds the first rename wins.

    Raises:
        OSError: creating, building or renaming failed (not a lost race); whatever ``build`` raises.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race: a real error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
