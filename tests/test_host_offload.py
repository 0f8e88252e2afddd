"""Parking device storages in host memory (:class:`slime.backends.host_offload.HostParking`), on CPU storages: the
bytes come back exactly, views and dictionary keys stay the same objects, a storage shared by views moves once, and a
tensor first seen later joins.  The CUDA path (pinned buffers, asynchronous copies) runs in
``tests/test_megatron_gpu.py``'s offload test."""

from __future__ import annotations

import pytest
import torch

from slime.backends.host_offload import HostParking


def _parking() -> HostParking:
    return HostParking(pin=False, device_types=("cpu",))


def test_park_frees_each_storage_once_and_restore_brings_the_same_bytes_back_into_the_same_objects():
    base = torch.randn(10, dtype=torch.float32)
    view = base[2:5]  # shares base's storage
    other = torch.arange(6, dtype=torch.float64).view(2, 3)
    state = {view: {"exp_avg": other}}  # keyed by the tensor object, as optimizer state is
    want_base, want_other = base.clone(), other.clone()
    parking = _parking()

    moved = parking.park([view, base, other])
    assert moved == 10 * 4 + 6 * 8  # base's storage counted once
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0 and parking.parked

    assert parking.restore() == moved and not parking.parked
    assert torch.equal(base, want_base) and torch.equal(view, want_base[2:5]) and torch.equal(other, want_other)
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # still one storage
    assert state[view]["exp_avg"] is other
    base[3] = 7.0  # writes through the view's storage as before
    assert view[1] == 7.0


def test_a_tensor_first_seen_later_joins_and_earlier_ones_keep_moving():
    first, later = torch.ones(3), torch.full((2,), 5.0)
    parking = _parking()
    parking.park([first])
    parking.restore()
    first.mul_(2)  # changed on the device between steps: the next park copies the new bytes
    assert parking.park([later]) == 3 * 4 + 2 * 4
    assert first.untyped_storage().nbytes() == 0 and later.untyped_storage().nbytes() == 0
    parking.restore()
    assert torch.equal(first, torch.full((3,), 2.0)) and torch.equal(later, torch.full((2,), 5.0))


def test_tensors_of_other_devices_are_left_alone_and_double_park_is_refused():
    t = torch.ones(4)
    parking = HostParking(pin=False, device_types=("cuda",))
    assert parking.park([t]) == 0 and t.untyped_storage().nbytes() == 16
    with pytest.raises(RuntimeError, match="twice"):
        parking.park([t])
    assert parking.restore() == 0 and parking.restore() == 0  # a second restore does nothing
