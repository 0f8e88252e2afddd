"""Flattened buckets: many named tensors as one ``uint8`` buffer plus metadata (SGLang 0.5.17's ``flattened_bucket``).

Payloads for ``/update_weights_from_tensor``: :func:`serialize_ipc_bucket` (a CUDA IPC handle, device by
UUID) and :func:`serialize_bucket_by_value` (a CPU copy); only classes SGLang's ``SafeUnpickler`` accepts
are pickled.  IPC and by-value buffers align each tensor to :data:`IPC_ALIGN` bytes; NCCL packs them back
to back (``align=1``).  The format and why: ``docs/design/weight_sync.md``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import types
from typing import Sequence

import torch

IPC_ALIGN = 16
"""Byte alignment of each tensor inside an IPC / by-value buffer."""


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Where one tensor (Hugging Face name, ``shape``, ``dtype``) sits in a buffer: bytes ``[start, start + nbytes)``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def for_sglang(self) -> types.SimpleNamespace:
        """SGLang's ``FlattenedTensorMetadata`` fields (``numel`` in bytes)."""
        return types.SimpleNamespace(name=self.name, shape=torch.Size(self.shape), dtype=self.dtype,
                                     start_idx=self.start, end_idx=self.end, numel=self.nbytes)


@dataclasses.dataclass
class FlatBucket:
    """``buffer``: 1-D ``uint8`` tensor (a fresh allocation); ``metadata``: one :class:`TensorMeta` per tensor."""

    buffer: torch.Tensor
    metadata: list[TensorMeta]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def layout(named_tensors: Sequence[tuple[str, torch.Tensor]], align: int = IPC_ALIGN) -> tuple[list[TensorMeta], int]:
    """``(metadata, total bytes)`` of ``named_tensors`` packed in order, each start a multiple of ``align`` bytes.

    Raises:
        ValueError: an empty bucket, a repeated name, or ``align < 1``.
    """
    if not named_tensors:
        raise ValueError("cannot flatten an empty bucket")
    if align < 1:
        raise ValueError(f"align must be >= 1 byte, got {align}")
    metadata, offset, seen = [], 0, set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one bucket")
        seen.add(name)
        offset = -(-offset // align) * align
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(TensorMeta(name, tuple(tensor.shape), tensor.dtype, offset, nbytes))
        offset += nbytes
    return metadata, offset


def flatten(named_tensors: Sequence[tuple[str, torch.Tensor]], device: torch.device | str | None = None,
            align: int = IPC_ALIGN) -> FlatBucket:
    """Copy ``named_tensors`` into one **new** ``uint8`` buffer on ``device`` (default: the first tensor's).

    A new buffer every call, since an engine may still be reading the previous one.

    Raises:
        ValueError: see :func:`layout`.
    """
    metadata, total = layout(named_tensors, align)
    device = torch.device(device) if device is not None else named_tensors[0][1].device
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    targets = [buffer[meta.start : meta.end] for meta in metadata]
    sources = [tensor.detach().contiguous().reshape(-1).view(torch.uint8) for _, tensor in named_tensors]
    if all(source.device == buffer.device for source in sources):
        # one multi-tensor kernel per few hundred tensors instead of one copy per tensor: a bucket of 3,469
        # expert tensors took 62-69 ms to flatten one copy at a time on the H200 (run 6), launch-bound
        torch._foreach_copy_(targets, sources)
    else:
        for target, source in zip(targets, sources):
            target.copy_(source)
    return FlatBucket(buffer, metadata)


def unflatten(buffer: torch.Tensor, metadata: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flattened buffer, as views into it (SGLang's ``reconstruct_tensors``)."""
    return [(m.name, buffer[m.start : m.end].view(m.dtype).reshape(m.shape)) for m in metadata]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class _CudaIpcTensor:
    """Pickles as torch's CUDA-IPC rebuild of ``tensor``, with the device named by UUID."""

    DEVICE_ARG = 6
    """Position of the storage device in the arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``
    (the same constant SGLang's ``patch_torch`` relies on)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __reduce__(self):
        from torch.multiprocessing import reductions

        rebuild, args = reductions.reduce_tensor(self.tensor)
        args = list(args)
        args[self.DEVICE_ARG] = str(torch.cuda.get_device_properties(args[self.DEVICE_ARG]).uuid)
        return rebuild, tuple(args)


def serialize_ipc_bucket(bucket: FlatBucket) -> str:
    """Base64 payload of one TP rank: the CUDA buffer as an IPC handle; keep ``bucket.buffer`` alive until loaded.

    Raises:
        ValueError: the buffer is not on a CUDA device.
    """
    if bucket.buffer.device.type != "cuda":
        raise ValueError(f"a CUDA IPC bucket must be on a CUDA device, got {bucket.buffer.device}")
    payload = {"flattened_tensor": _CudaIpcTensor(bucket.buffer), "metadata": [m.for_sglang() for m in bucket.metadata]}
    return base64.b64encode(pickle.dumps(payload)).decode()


def serialize_bucket_by_value(bucket: FlatBucket) -> str:
    """Base64 payload with a CPU copy of the buffer inside (SGLang engines fed through the object store)."""
    payload = {"flattened_tensor": bucket.buffer.cpu(), "metadata": [m.for_sglang() for m in bucket.metadata]}
    buf = io.BytesIO()
    pickle.dump(payload, buf)
    return base64.b64encode(buf.getvalue()).decode()
