"""Packed sequences (THD): documents end to end on one token axis, boundaries ``cu_seqlens`` (int32,
``[0, L_0, L_0 + L_1, ..., T]``, FlashAttention's, fla's and megatron-core's convention).

Optional trailing padding (so that ``T`` is a multiple of the sequence-parallel size) is one more document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class PackedSequences:
    """Boundaries of the documents packed into one token axis, and the index maps of the torch kernel paths.

    Attributes:
        cu_seqlens: ``[n + 1]`` int32, ``cu_seqlens[0] = 0``, non-decreasing, ``cu_seqlens[-1] = T``.
        max_seqlen: the longest document, tokens.
        num_padding: tokens of the trailing padding document (0 when none).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_padding: int = 0

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int], *, pad_to_multiple_of: int = 1, device: torch.device | str | None = None
    ) -> "PackedSequences":
        """Boundaries for documents of ``lengths`` tokens, plus a padding document up to ``pad_to_multiple_of``.

        Raises:
            ValueError: no documents, a length < 1, or ``pad_to_multiple_of`` < 1.
        """
        lengths = [int(n) for n in lengths]
        if not lengths:
            raise ValueError("cannot pack zero sequences")
        bad = [i for i, n in enumerate(lengths) if n < 1]
        if bad:
            raise ValueError(f"sequence {bad[0]} has length {lengths[bad[0]]}; every packed sequence needs >= 1 token")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        total = sum(lengths)
        padding = (-total) % pad_to_multiple_of
        all_lengths = lengths + ([padding] if padding else [])
        cu = torch.zeros(len(all_lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(all_lengths, dtype=torch.int64), 0).to(torch.int32)
        return cls(cu_seqlens=cu.to(device) if device is not None else cu, max_seqlen=max(all_lengths),
                   num_padding=padding)

    @property
    def lengths(self) -> torch.Tensor:
        """``[n]`` int64 tokens per document (the padding document included)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    @property
    def num_sequences(self) -> int:
        """Documents, the padding document included."""
        return self.cu_seqlens.numel() - 1

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def document_ids(self) -> torch.Tensor:
        """``[T]`` int64: the document of each token."""
        return torch.repeat_interleave(torch.arange(self.num_sequences, device=self.cu_seqlens.device), self.lengths)

    def positions(self) -> torch.Tensor:
        """``[T]`` int64: each token's position inside its document."""
        starts = self.cu_seqlens[:-1].long()
        return torch.arange(self.total_tokens, device=self.cu_seqlens.device) - starts[self.document_ids()]

    def batch_index(self, padded_len: int | None = None) -> torch.Tensor:
        """``[T]`` int64 flat index of each token in a ``[n, padded_len]`` batch."""
        padded_len = self.max_seqlen if padded_len is None else padded_len
        return self.document_ids() * padded_len + self.positions()

    def to_batch(self, x: torch.Tensor, padded_len: int | None = None) -> torch.Tensor:
        """Scatter packed ``x [T, ...]`` into a zero-padded batch ``[n, padded_len, ...]`` (differentiable)."""
        padded_len = self.max_seqlen if padded_len is None else padded_len
        if padded_len < self.max_seqlen:
            raise ValueError(f"padded_len {padded_len} is below the longest document ({self.max_seqlen})")
        flat = x.new_zeros((self.num_sequences * padded_len, *x.shape[1:]))
        flat = flat.index_copy(0, self.batch_index(padded_len), x)
        return flat.view(self.num_sequences, padded_len, *x.shape[1:])

    def from_batch(self, y: torch.Tensor) -> torch.Tensor:
        """Gather a batch ``[n, padded_len, ...]`` back to ``[T, ...]`` (differentiable)."""
        n, padded_len = y.shape[:2]
        if n != self.num_sequences:
            raise ValueError(f"batch has {n} rows, the packing {self.num_sequences} documents")
        return y.reshape(n * padded_len, *y.shape[2:]).index_select(0, self.batch_index(padded_len))

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Packed ``x [T, ...]`` as per-document views."""
        return list(torch.split(x, self.lengths.tolist(), dim=0))


def pack_sequences(
    sequences: Sequence[torch.Tensor], *, pad_to_multiple_of: int = 1, pad_value: int = 0
) -> tuple[torch.Tensor, PackedSequences]:
    """Concatenate 1-D token tensors ``[L_i]`` into ``(tokens [T], packing)``, padding (``pad_value``) at the end.

    Raises:
        ValueError: see :meth:`PackedSequences.from_lengths`; a tensor that is not 1-D.
    """
    for i, seq in enumerate(sequences):
        if seq.dim() != 1:
            raise ValueError(f"sequence {i} has shape {tuple(seq.shape)}; pack 1-D token tensors")
    packing = PackedSequences.from_lengths(
        [s.numel() for s in sequences], pad_to_multiple_of=pad_to_multiple_of,
        device=sequences[0].device if sequences else None,
    )
    pieces = list(sequences)
    if packing.num_padding:
        pieces.append(torch.full((packing.num_padding,), pad_value, dtype=sequences[0].dtype,
                                 device=sequences[0].device))
    return torch.cat(pieces), packing


def packing_from_params(packed_seq_params, total: int, batch: int, device) -> PackedSequences:
    """The documents of a micro-batch: megatron-core's ``PackedSeqParams`` (THD, batch 1), or one per batch column.

    ``total`` is the tokens per batch column; that ``cu_seqlens`` ends there is checked by the model, once.

    Raises:
        ValueError: THD with batch > 1.
    """
    if packed_seq_params is not None:
        if batch != 1:
            raise ValueError(f"packed (THD) input must have batch size 1, got {batch}")
        cu = packed_seq_params.cu_seqlens_q
        max_len = packed_seq_params.max_seqlen_q
        max_len = int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
        return PackedSequences(cu_seqlens=cu.to(device=device, dtype=torch.int32), max_seqlen=max_len)
    return PackedSequences.from_lengths([total] * batch, device=device)
