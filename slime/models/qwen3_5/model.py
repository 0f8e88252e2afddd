"""The native Qwen3.5-MoE vision-language model: megatron-core's decoder with this package's layers.

A ``Qwen35Model`` stage holds: on the first stage megatron-core's ``VocabParallelEmbedding`` and the
transformers vision tower; on every stage a ``TransformerBlock`` of its layers
(:func:`slime.models.qwen3_5.spec.qwen35_block_spec`); on the last the final norm and the untied,
column-parallel LM head.  Inputs are packed THD micro-batches (:class:`Qwen35Inputs`); activations are
``[S, 1, hidden]`` (``S = T / tp`` under sequence parallelism).
"""

from __future__ import annotations

import dataclasses

import torch

from slime.models.qwen3_5.config import Qwen35Config
from slime.models.qwen3_5.rope import inv_frequencies, mrope_frequencies
from slime.models.qwen3_5.router import replayed_routes
from slime.models.qwen3_5.vision import (
    build_vision_tower,
    image_features,
    scatter_image_features,
    vision_attention_for,
)


def to_device(t: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """``t`` on ``device`` (None stays None).  A host tensor bound for a CUDA device is first copied into page-locked
    memory, then sent with ``non_blocking=True``: a copy from pageable memory first waits for every kernel already
    queued on the stream (CUDA's rule for pageable copies), so each micro-batch's inputs cost a host synchronisation
    and the GPU idles while the host queues the next forward; a pinned copy is queued like a kernel.  Torch's pinned
    host allocator keeps the page-locked source until the copy has run."""
    if t is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclasses.dataclass
class Qwen35Document:
    """One sequence (prompt + response) before packing.

    Attributes:
        input_ids: ``[L]`` int64 token ids, image placeholders expanded (one per merged token).
        pixel_values: ``[P_i, C * temporal_patch * patch**2]`` of this sequence's images, or ``None``.
        image_grid_thw: ``[num_images_i, 3]`` int64 patch grids, or ``None``.
    """

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


@dataclasses.dataclass
class Qwen35Inputs:
    """One packed (THD) micro-batch for :class:`Qwen35Model`.

    Attributes:
        input_ids: ``[T]`` int64 token ids, documents end to end (``T`` a multiple of TP under SP).
        position_ids: ``[3, T]`` int64 MRoPE positions (``slime.models.qwen3_5.rope.packed_position_ids``).
        cu_seqlens: ``[n + 1]`` int32 document boundaries (``cu_seqlens[-1] = T``).
        max_seqlen: longest document, tokens.
        pixel_values: ``[P, C * temporal_patch * patch**2]`` of all images in document order, or ``None``.
        image_grid_thw: ``[num_images, 3]`` int64, or ``None``.
        image_tokens_per_document: ``n`` merged image-token counts (0 for text-only); required with images.
        logit_index: ``[K]`` int64 positions of the packed axis whose logits the last stage computes, in
            that order; ``None``: all ``T``.
        routed_experts: int ``[T, layers, top_k]`` experts every MoE layer takes at each position (``-1`` rows:
            the router's own choice; :func:`slime.routing_replay.token_routes`), or ``None``: the routers choose.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_tokens_per_document: list[int] | None = None
    logit_index: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @classmethod
    def pack(cls, documents: "list[Qwen35Document]", arch, *, pad_to_multiple_of: int = 1, pad_token_id: int = 0
             ) -> "Qwen35Inputs":
        """Pack documents into one THD micro-batch, ``T`` padded to a multiple of ``pad_to_multiple_of``.

        Raises:
            slime.models.qwen3_5.rope.PositionError: a document's image tokens and grids disagree (naming it).
        """
        from slime.models.qwen3_5.packing import pack_sequences
        from slime.models.qwen3_5.rope import packed_position_ids

        ids, packing = pack_sequences([d.input_ids for d in documents], pad_to_multiple_of=pad_to_multiple_of,
                                      pad_value=pad_token_id)
        grids = [d.image_grid_thw for d in documents]
        positions = packed_position_ids([d.input_ids for d in documents], grids, image_token_id=arch.image_token_id,
                                        spatial_merge_size=arch.spatial_merge_size,
                                        video_token_id=arch.video_token_id, num_padding=packing.num_padding)
        merge = arch.spatial_merge_size**2
        counts = [0 if g is None else int(g.prod(-1).sum()) // merge for g in grids] + [0] * (packing.num_padding > 0)
        pixels = [d.pixel_values for d in documents if d.pixel_values is not None]
        used = [g for g in grids if g is not None and g.numel()]
        return cls(
            input_ids=ids, position_ids=positions, cu_seqlens=packing.cu_seqlens, max_seqlen=packing.max_seqlen,
            pixel_values=torch.cat(pixels) if pixels else None, image_grid_thw=torch.cat(used) if used else None,
            image_tokens_per_document=counts if pixels else None,
        )

    def to(self, device) -> "Qwen35Inputs":
        """The same micro-batch with its tensors on ``device``."""
        move = lambda t: to_device(t, device)  # noqa: E731
        return dataclasses.replace(self, input_ids=move(self.input_ids), position_ids=move(self.position_ids),
                                   cu_seqlens=move(self.cu_seqlens), pixel_values=move(self.pixel_values),
                                   image_grid_thw=move(self.image_grid_thw), logit_index=move(self.logit_index),
                                   routed_experts=move(self.routed_experts))

    def packed_seq_params(self):
        """megatron-core's ``PackedSeqParams`` (THD) of these boundaries."""
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=self.max_seqlen,
                               max_seqlen_kv=self.max_seqlen)


def megatron_without_transformer_engine() -> None:
    """Define megatron-core 0.16.1's ``moe_utils.te_general_gemm`` as ``None`` without TE (its router's torch path)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class Qwen35Model(_megatron_module()):
    """One pipeline stage of the native Qwen3.5-MoE model.

    Args:
        config: :class:`~slime.models.qwen3_5.config.Qwen35Config`.
        pre_process, post_process: this stage holds the embedding (and vision tower) / the final norm and LM head.
        vision: build the vision tower on the first stage (needs ``arch.vision_config``).
        pg_collection, vp_stage: megatron-core's process groups and virtual pipeline stage.

    Build large models under ``torch.device("meta")``; :func:`slime.models.qwen3_5.weights.load_hf_checkpoint`
    materialises and fills them.
    """

    def __init__(self, config: Qwen35Config, *, pre_process: bool = True, post_process: bool = True,
                 vision: bool = True, pg_collection=None, vp_stage: int | None = None):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
        from megatron.core.transformer.transformer_block import TransformerBlock

        from slime.models.qwen3_5.spec import qwen35_block_spec

        from megatron.core.enums import ModelType

        megatron_without_transformer_engine()
        tc = config.transformer
        super().__init__(config=tc)
        self.model_type = ModelType.encoder_or_decoder  # what megatron-core's schedules read
        self.qwen_config = config
        self.pre_process, self.post_process = pre_process, post_process
        arch = config.arch
        self.vocab_size, self.padded_vocab_size = arch.vocab_size, config.padded_vocab_size
        tp_group = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
        self.tp_rank, self.tp_size = tp_group.rank(), tp_group.size()
        pp_group = getattr(pg_collection, "pp", None) or parallel_state.get_pipeline_model_parallel_group()
        self.embedding = self.visual = self.output_layer = None
        if pre_process:
            self.embedding = VocabParallelEmbedding(self.padded_vocab_size, arch.hidden_size,
                                                    init_method=tc.init_method, config=tc, tp_group=tp_group)
            if vision and arch.vision_config is not None:
                self.visual = build_vision_tower(arch.vision_config, dtype=tc.params_dtype, device=_build_device(tc),
                                                 attn_implementation=vision_attention_for(config.kernels.attention))
        self.decoder = TransformerBlock(
            tc, qwen35_block_spec(config, pp_rank=pp_group.rank(), vp_stage=vp_stage), pre_process=pre_process,
            post_process=post_process, pg_collection=pg_collection, vp_stage=vp_stage,
        )
        if post_process:
            self.output_layer = ColumnParallelLinear(
                arch.hidden_size, self.padded_vocab_size, config=tc, init_method=tc.init_method, bias=False,
                gather_output=False, skip_bias_add=False, tp_group=tp_group,
            )
        self.register_buffer("inv_freq", torch.empty(arch.rotary_dim // 2, device=_build_device(tc)),
                             persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the fp32 RoPE inverse frequencies (after ``to_empty`` as well)."""
        arch = self.qwen_config.arch
        if self.inv_freq.device.type != "meta":
            self.inv_freq.copy_(inv_frequencies(arch.rotary_dim, arch.rope_theta, device=self.inv_freq.device))

    def set_input_tensor(self, input_tensor) -> None:
        """megatron-core's pipeline schedules hand the previous stage's activations in here."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def embed(self, inputs: Qwen35Inputs) -> torch.Tensor:
        """First stage: ``[S, 1, hidden]`` token embeddings with the image features scattered in."""
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        arch = self.qwen_config.arch
        embeddings = self.embedding(inputs.input_ids.view(1, -1))[0]  # [T, hidden]
        if inputs.pixel_values is not None:
            if self.visual is None:
                raise ValueError("the micro-batch has pixel_values but the model was built without a vision tower")
            if inputs.image_tokens_per_document is None:
                raise ValueError("pixel_values given without image_tokens_per_document")
            features = image_features(self.visual, inputs.pixel_values, inputs.image_grid_thw)
            embeddings = scatter_image_features(
                embeddings, inputs.input_ids, features, image_token_id=arch.image_token_id,
                cu_seqlens=inputs.cu_seqlens, tokens_per_document=inputs.image_tokens_per_document,
            )
        embeddings = embeddings.unsqueeze(1)
        if self.config.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings)
        return embeddings

    def forward(self, inputs: Qwen35Inputs) -> torch.Tensor:
        """Run this stage (with ``inputs.routed_experts``, its routers replay them: :func:`replayed_routes`).

        Returns:
            Last stage: logits ``[T, 1, Vp / tp]`` (this TP rank's vocabulary columns, padding columns at the
            dtype's lowest value), or ``[K, 1, Vp / tp]`` at ``inputs.logit_index``.  Other stages: hidden
            states ``[S, 1, hidden]``.

        Raises:
            ValueError: ``cu_seqlens`` does not end at ``T``; image placeholders and images disagree (naming
                the document).
        """
        total = inputs.input_ids.numel()
        if int(inputs.cu_seqlens[-1]) != total:
            raise ValueError(f"cu_seqlens ends at {int(inputs.cu_seqlens[-1])} but input_ids has {total} tokens")
        arch = self.qwen_config.arch
        hidden = self.embed(inputs) if self.pre_process else None
        freqs = mrope_frequencies(inputs.position_ids, self.inv_freq, arch.mrope_section, arch.mrope_interleaved)
        sp_size = self.tp_size if self.config.sequence_parallel else 1
        with replayed_routes(self, inputs.routed_experts, sp_rank=self.tp_rank % sp_size, sp_size=sp_size):
            hidden = self.decoder(hidden, attention_mask=None, rotary_pos_emb=freqs,
                                  packed_seq_params=inputs.packed_seq_params())
        if not self.post_process:
            return hidden
        if inputs.logit_index is not None:
            hidden = self._select_positions(hidden, inputs.logit_index)
        logits, _ = self.output_layer(hidden)
        if inputs.logit_index is not None:
            logits = logits[: inputs.logit_index.numel()]
        if self.padded_vocab_size > self.vocab_size:
            per = self.padded_vocab_size // self.tp_size
            columns = torch.arange(per, device=logits.device) + self.tp_rank * per
            logits = logits.masked_fill(columns >= self.vocab_size, torch.finfo(logits.dtype).min)
        return logits

    def _select_positions(self, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The final hidden states at ``index``, ``[K, 1, hidden]``, split over TP again under SP (padded)."""
        from megatron.core.tensor_parallel import (
            gather_from_sequence_parallel_region,
            scatter_to_sequence_parallel_region,
        )

        if not self.config.sequence_parallel:
            return hidden.index_select(0, index)
        full = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        picked = full.index_select(0, index)
        padding = (-picked.shape[0]) % self.tp_size
        if padding:
            picked = torch.cat([picked, picked.new_zeros(padding, *picked.shape[1:])])
        return scatter_to_sequence_parallel_region(picked)


def _build_device(tc):
    from slime.models.qwen3_5.norm import param_device

    return param_device(tc)
