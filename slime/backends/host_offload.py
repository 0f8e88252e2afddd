"""Device memory parked in page-locked host buffers while colocated engines use the GPU.

megatron-core's RL offload of the optimizer (``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` in 0.16.1)
moves every fp32 main weight and Adam moment with ``tensor.cpu()`` / ``.cuda()``: a synchronous copy into freshly
allocated pageable memory, one tensor at a time, every step.  :class:`HostParking` instead copies each device
*storage* once into a page-locked (pinned) host buffer that it keeps for the whole run, then frees the device storage
in place (``untyped_storage().resize_(0)``), so every tensor object, view and dictionary key stays what it was
(optimizer state is keyed by its parameter objects).  Copies run asynchronously at the PCIe / NVLink-C2C copy
engine's rate, with one device synchronisation per move.  Why: ``docs/design/training_step.md``.

A restore may instead run in the background on a side CUDA stream (``restore(stream=...)``): it returns once the
copies are queued, and :meth:`HostParking.wait` makes the caller's stream wait for them on the device (no host
block).  The colocated Megatron step restores its optimizer state that way, so the copies overlap the forward and
backward passes, which never read it (the fourth sub-phase table in ``docs/results/h200_train_phase.md``).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor


class HostParking:
    """Park the storages of a fixed set of device tensors in host memory and bring them back.

    Args:
        pin: allocate the host buffers page-locked (``pin_memory=True``; needs CUDA); False in CPU-only tests.
        device_types: the devices whose tensors move (``("cuda",)``; tests use ``("cpu",)``).

    Each :meth:`park` moves the storages of the tensors it is given plus every storage parked before (views of one
    buffer move once; a tensor first seen later, e.g. Adam's moments after the first step, joins then).  Host memory
    held: the storages' bytes, from their first :meth:`park` to the end of the process.
    """

    def __init__(self, pin: bool = True, device_types: tuple[str, ...] = ("cuda",)):
        self.pin, self.device_types = pin, device_types
        self._parked = False
        self._pending = None  # the CUDA event after a background restore's copies, until wait()
        self._slots: dict[int, tuple[torch.UntypedStorage, Tensor, int]] = {}  # StorageImpl -> (storage, host, bytes)

    @property
    def parked(self) -> bool:
        """Whether the storages are in host memory now (their device storages have size 0)."""
        return self._parked

    @property
    def nbytes(self) -> int:
        """Bytes of the storages under management (0 before the first :meth:`park`)."""
        return sum(n for _, _, n in self._slots.values())

    def park(self, tensors: Iterable[Tensor]) -> int:
        """Copy the storages of ``tensors`` (those on :attr:`device_types`) and of every earlier :meth:`park` into
        their host buffers, then free them on the device; returns the bytes moved.

        Raises:
            RuntimeError: already parked (no :meth:`restore` since).
        """
        if self._parked:
            raise RuntimeError("HostParking.park called twice without restore")
        self.wait()  # a background restore's copies land before the bytes are copied back out
        self._add(tensors)
        slots = list(self._slots.values())
        for storage, host, nbytes in slots:
            host.copy_(_bytes_view(storage, nbytes), non_blocking=True)
        _wait(slots)
        for storage, _, _ in slots:
            storage.resize_(0)
        self._parked = True
        return self.nbytes

    def restore(self, stream=None) -> int:
        """Re-allocate each device storage at its size and copy its bytes back; returns the bytes moved (0 when not
        parked).

        Args:
            stream: None: the copies run on the current stream and the device is synchronised before returning.  A
                ``torch.cuda.Stream``: the copies are queued on it after the work already queued on the current stream
                (the storages are allocated there, stream-ordered), and ``restore`` returns at once; the tensors may be
                read only after :meth:`wait` (or a device synchronisation).
        """
        if not self._parked:
            return 0
        slots = list(self._slots.values())
        background = stream is not None and any(storage.device.type == "cuda" for storage, _, _ in slots)
        for storage, _, nbytes in slots:
            storage.resize_(nbytes)  # allocated on the current stream
        if background:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            with torch.cuda.stream(stream):
                for storage, host, nbytes in slots:
                    view = _bytes_view(storage, nbytes)
                    view.copy_(host, non_blocking=True)
                    view.record_stream(stream)  # a free before wait() must not hand the block out mid-copy
                self._pending = torch.cuda.Event()
                self._pending.record(stream)
        else:
            for storage, host, nbytes in slots:
                _bytes_view(storage, nbytes).copy_(host, non_blocking=True)
            _wait(slots)
        self._parked = False
        return self.nbytes

    @property
    def pending(self) -> bool:
        """Whether a background :meth:`restore`'s copies may still be running (no :meth:`wait` since)."""
        return self._pending is not None

    def wait(self) -> None:
        """Make the current CUDA stream wait (on the device, the host does not block) for a background
        :meth:`restore`'s copies; nothing to do after a foreground one."""
        if self._pending is not None:
            torch.cuda.current_stream().wait_event(self._pending)
            self._pending = None

    def readable(self, t: Tensor) -> Tensor:
        """``t`` to read from: ``t`` itself unless its storage is parked now, else a CPU tensor of ``t``'s dtype,
        shape, strides and offset over the parked bytes (no copy; valid until the next :meth:`restore` or
        :meth:`park`).  For what reads state while colocated engines hold the GPU (a checkpoint save after the
        step's offload): a parked device storage has size 0, and reading it fails (CUDA: "invalid argument")."""
        slot = self._slots.get(t.untyped_storage()._cdata) if self._parked else None
        if slot is None:
            return t
        _, host, _ = slot
        return torch.empty(0, dtype=t.dtype).set_(host.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    def _add(self, tensors: Iterable[Tensor]) -> None:
        """Give each new storage of ``tensors`` (on :attr:`device_types`, not empty) its host buffer."""
        for t in tensors:
            if t.device.type not in self.device_types:
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the StorageImpl: stable across resize_, shared by every view
            if key in self._slots or storage.nbytes() == 0:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.pin)
            self._slots[key] = (storage, host, storage.nbytes())


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> Tensor:
    """A flat uint8 tensor over the whole of ``storage`` (``nbytes`` long)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _wait(slots) -> None:
    """Wait for the queued copies of ``slots`` (on their CUDA device; nothing to wait for elsewhere)."""
    devices = {storage.device for storage, _, _ in slots if storage.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)
