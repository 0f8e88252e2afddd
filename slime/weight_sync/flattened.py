"""Flattened buckets: many named tensors as one byte buffer plus metadata, SGLang's ``flattened_bucket`` format.

SGLang 0.5.17 (``sglang/srt/weight_sync/tensor_bucket.py``,
``model_runner_components/weight_updater.py``) rebuilds each tensor of a bucket as
``buffer[start_idx:end_idx].view(dtype).reshape(shape)`` from a 1-D ``uint8`` buffer and, per
tensor, an object with the attributes ``name, shape, dtype, start_idx, end_idx, numel`` (``numel``
in bytes).  Two slime transports send buckets that way:

- **CUDA IPC** (:mod:`slime.weight_sync.cuda_ipc`): :func:`serialize_ipc_bucket` pickles
  ``{"flattened_tensor": <CUDA buffer>, "metadata": [...]}`` so that the buffer travels as a CUDA IPC
  handle (the memory stays where it is; the server maps it), with the device given by its UUID
  instead of this process's index (SGLang's ``monkey_patch_torch_reductions`` maps a UUID back to
  its own index: trainer and server number the GPUs differently).  One payload per TP rank, each
  made on that rank's GPU (``/update_weights_from_tensor``'s ``serialized_named_tensors``).
- **Object store** to an SGLang engine: :func:`serialize_bucket_by_value` pickles a CPU buffer by
  value (for CPU tests and runs without a GPU transport).

Only classes that SGLang's ``SafeUnpickler`` accepts are pickled (``torch.*``, ``builtins``,
``types.SimpleNamespace`` for the metadata), so slime needs no SGLang import to build payloads.

NCCL (``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``) broadcasts the
same buffer, but the server rebuilds the layout itself without gaps, so :func:`flatten` packs
tensors back to back (``align=1``) there; the IPC and by-value payloads carry explicit offsets and
align every tensor to 16 bytes, which ``Tensor.view(dtype)`` needs for mixed dtypes.
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
    """Where one tensor sits in a flattened buffer.

    Attributes:
        name: Hugging Face checkpoint name.
        shape: the tensor's shape.
        dtype: its dtype.
        start: first byte in the buffer.
        nbytes: its size, bytes (``numel * element_size``).
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
        """SGLang's ``FlattenedTensorMetadata`` fields (``numel`` in bytes of the ``uint8`` buffer)."""
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
    """Offsets of ``named_tensors`` packed in order, each start a multiple of ``align`` bytes.

    Returns:
        ``(metadata, total bytes)``.

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

    A new buffer every call: an engine may still be reading the previous one.

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
    """``torch.bfloat16`` -> ``"bfloat16"`` (SGLang's ``getattr(torch, name)``)."""
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
    """Base64 payload of one TP rank for ``/update_weights_from_tensor`` (``load_format="flattened_bucket"``):
    the CUDA buffer as an IPC handle.  The caller keeps ``bucket.buffer`` alive until the engine has loaded it.

    Raises:
        ValueError: the buffer is not on a CUDA device.
    """
    if bucket.buffer.device.type != "cuda":
        raise ValueError(f"a CUDA IPC bucket must be on a CUDA device, got {bucket.buffer.device}")
    payload = {"flattened_tensor": _CudaIpcTensor(bucket.buffer), "metadata": [m.for_sglang() for m in bucket.metadata]}
    return base64.b64encode(pickle.dumps(payload)).decode()


def serialize_bucket_by_value(bucket: FlatBucket) -> str:
    """Base64 payload with the buffer's bytes inside (a CPU copy), for SGLang engines fed through the object store."""
    payload = {"flattened_tensor": bucket.buffer.cpu(), "metadata": [m.for_sglang() for m in bucket.metadata]}
    buf = io.BytesIO()
    pickle.dump(payload, buf)
    return base64.b64encode(buf.getvalue()).decode()
