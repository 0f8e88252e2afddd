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


def test_parked_tensors_read_from_their_host_bytes_with_their_dtype_shape_strides_and_offset():
    base = torch.randn(4, 6, dtype=torch.float32)
    view = base[1:, 2:5]  # offset 8, strides (6, 1): not contiguous
    moments = torch.arange(5, dtype=torch.bfloat16)
    want_view, want_moments = view.clone(), moments.clone()
    parking = _parking()
    assert parking.readable(view) is view  # nothing parked: the tensor itself
    parking.park([base, moments])
    read = parking.readable(view)
    assert read.dtype == torch.float32 and read.shape == (3, 3) and read.stride() == (6, 1)
    assert torch.equal(read, want_view) and torch.equal(parking.readable(moments), want_moments)
    loose = torch.ones(2)  # not under management: itself
    assert parking.readable(loose) is loose
    parking.restore()
    assert parking.readable(view) is view and torch.equal(view, want_view)


@pytest.mark.parametrize("param_device", ["cpu", "meta"])
def test_a_checkpoint_read_of_the_optimizer_state_while_it_is_parked_gives_its_values(param_device):
    """The GPU run of issue 30 (H100, 2026-12-06): every launcher run failed at its save, after the step's offload,
    with "CUDA error: invalid argument" in ``DistributedAdam.param_state`` (it read the parked, size-0 main weights).
    Here on CPU storages, with megatron-core's optimizer replaced by the attributes ``param_state`` reads: one bf16
    parameter of 8 elements whose fp32 shard is all of it.

    ``meta``: the parameter lives on another device than the parked state (a GPU that the colocated engines hold):
    with one data-parallel rank the whole-parameter tensors are built in host memory, beside the parked bytes (the
    launcher's MTP run of 2026-12-07 ran out of GPU memory at its save building them on the parameter's device)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from slime.backends.megatron.optimizer import DistributedAdam

    param = torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.bfloat16, device=param_device))
    main = torch.linspace(-1.0, 1.0, 8)
    state = {"exp_avg": torch.full((8,), 0.25), "exp_avg_sq": torch.arange(8.0) / 100, "step": torch.tensor(3.0)}
    part = SimpleNamespace(
        buffers=[SimpleNamespace(param_index_map={param: None})], model_param_gbuf_map={param: None},
        _get_model_param_range_map=lambda p: {"param": SimpleNamespace(start=0, end=8)}, optimizer=SimpleNamespace(state={main: state}),
        model_float16_groups=[[param]], shard_fp32_from_float16_groups=[[main]], model_fp32_groups=[],
        shard_fp32_groups=[], data_parallel_group=None)
    adam = DistributedAdam.__new__(DistributedAdam)  # no megatron-core model: the attributes param_state reads
    adam.parts, adam.parking = [part], _parking()
    adam.ddp = SimpleNamespace(buffers=[], expert_parallel_buffers=[])
    want = {"param": main.clone().view(2, 4), "exp_avg": state["exp_avg"].clone().view(2, 4),
            "exp_avg_sq": state["exp_avg_sq"].clone().view(2, 4)}
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        adam.parking.park([main, *state.values()])
        assert main.untyped_storage().nbytes() == 0  # as on the GPU after the offload
        got = adam.param_state(param)
        for key, value in want.items():
            assert got[key].device.type == "cpu", key  # never the (stand-in) GPU
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    finally:
        if started:
            dist.destroy_process_group()


def test_the_fp32_main_weight_of_an_fp32_parameter_reads_from_its_offloaded_buffer():
    """The next GPU run (H100, 2026-12-06) still failed at the save, in the same ``param_state`` line: the fp32 main
    weight of an fp32 model parameter (``A_log``) is a view of the parameter, which lives in a DDP parameter buffer
    that megatron-core's ``offload_to_cpu`` frees (its copy in ``param_data_cpu``), not in :class:`HostParking`.  Here
    megatron-core's offload is done by hand on a CPU buffer of 12 fp32 elements: the parameter is elements 4-9 of it,
    its shard (this rank's) elements 1-4 of the parameter, and the moments are parked."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from slime.backends.megatron.optimizer import DistributedAdam

    param_data = torch.arange(12, dtype=torch.float32) / 8
    param = torch.nn.Parameter(param_data[4:10].view(2, 3))  # a view of the buffer, as DDP makes it
    main = param.detach().view(-1)[1:5]  # megatron-core's shard of an fp32 parameter: a view of it
    state = {"exp_avg": torch.full((4,), 0.5), "exp_avg_sq": torch.arange(4.0) / 10, "step": torch.tensor(2.0)}
    part = SimpleNamespace(
        buffers=[SimpleNamespace(param_index_map={param: None})], model_param_gbuf_map={param: None},
        _get_model_param_range_map=lambda p: {"param": SimpleNamespace(start=1, end=5)},
        optimizer=SimpleNamespace(state={main: state}), model_float16_groups=[], shard_fp32_from_float16_groups=[],
        model_fp32_groups=[[param]], shard_fp32_groups=[[main]], data_parallel_group=None)
    buffer = SimpleNamespace(param_data=param_data, param_data_cpu=None)
    adam = DistributedAdam.__new__(DistributedAdam)
    adam.parts, adam.parking = [part], _parking()
    adam.ddp = SimpleNamespace(buffers=[buffer], expert_parallel_buffers=[])
    # by hand: the parameter's elements 1-4 are buffer elements 5-8, i.e. (5, 6, 7, 8) / 8; the rest of the whole
    # parameter is 0 (another rank's shard, summed in by the all-reduce of one rank)
    want_param = torch.tensor([0.0, 5, 6, 7, 8, 0]).view(2, 3) / 8
    want_avg = torch.tensor([0.0, 0.5, 0.5, 0.5, 0.5, 0]).view(2, 3)
    want_sq = torch.tensor([0.0, 0.0, 0.1, 0.2, 0.3, 0]).view(2, 3)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        adam.parking.park(list(state.values()))
        buffer.param_data_cpu = param_data.clone()  # megatron-core's offload_to_cpu: copy, then free the storage
        param_data.untyped_storage().resize_(0)
        assert main.untyped_storage().nbytes() == 0
        got = adam.param_state(param)
        torch.testing.assert_close(got["param"], want_param, rtol=0, atol=0)
        torch.testing.assert_close(got["exp_avg"], want_avg, rtol=0, atol=0)
        torch.testing.assert_close(got["exp_avg_sq"], want_sq, rtol=0, atol=1e-7)
    finally:
        if started:
            dist.destroy_process_group()


def _adam_with_recorders(calls):
    """A :class:`DistributedAdam` without megatron-core: its parking and megatron-core's optimizer record their calls
    in ``calls``; one optimizer part whose state is empty and that owns no parameter."""
    from types import SimpleNamespace

    from slime.backends.megatron.optimizer import DistributedAdam

    class Parking:
        def wait(self):
            calls.append("wait")

    mcore = SimpleNamespace(
        prepare_grads=lambda: calls.append("prepare_grads"), get_grad_norm=lambda: calls.append("norm") or 2.0,
        step_with_ready_grads=lambda: calls.append("step") or True, zero_grad=lambda: None)
    part = SimpleNamespace(optimizer=SimpleNamespace(state={}, param_groups=[]), buffers=[],
                           _init_optimizer_states_with_dummy_values=lambda: calls.append("create_state"))
    adam = DistributedAdam.__new__(DistributedAdam)
    adam.parking, adam.optimizer, adam.parts = Parking(), mcore, [part]
    adam.cfg = SimpleNamespace(weight_decay=0.0)
    adam.ddp = SimpleNamespace(zero_grad_buffer=lambda: None)
    return adam


def test_the_optimizer_waits_for_a_background_onload_before_it_reads_its_state():
    """The colocated Megatron step restores its optimizer state on a side stream (``HostParking.restore(stream=)``)
    that overlaps the forward and backward passes: the gradient norm and the step first make the current stream wait
    for those copies (``HostParking.wait``), before megatron-core's optimizer is called.  The parking and
    megatron-core's optimizer are recorders here (no GPU)."""
    calls = []
    adam = _adam_with_recorders(calls)
    assert adam.grad_norm() == 2.0
    adam.step(lr=1e-3, grad_scale=1.0)
    assert calls == ["wait", "prepare_grads", "norm", "wait", "step"]


@pytest.mark.parametrize("method", ["ensure_state", "param_state", "set_param_state"])
def test_the_optimizer_states_readers_and_writers_wait_for_a_background_onload_first(method):
    """A checkpoint's load (``ensure_state``, ``set_param_state``) or save (``param_state``) may come right after an
    onload, before any step: each waits for the copies before it touches the state.  The recorder part owns no
    parameter, so the two per-parameter methods stop with KeyError at their first look at the state."""
    calls = []
    adam = _adam_with_recorders(calls)
    param = torch.zeros(2)
    if method == "ensure_state":
        adam.ensure_state()
    else:
        with pytest.raises(KeyError, match="no optimizer buffer"):
            getattr(adam, method)(param) if method == "param_state" else adam.set_param_state(param, {}, 1)
    assert calls[0] == "wait"
    assert calls == (["wait", "create_state"] if method == "ensure_state" else ["wait"])


def test_a_park_first_makes_the_current_stream_wait_for_a_background_restore(monkeypatch):
    """The next park copies the state back out into the same pinned host buffers: it first orders the current stream
    after a background restore's copies (the event recorded on the side stream), or it could read half-restored
    bytes.  The CUDA stream and event are recorders here (no GPU)."""
    waited = []

    class Stream:
        def wait_event(self, event):
            waited.append(event)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    parking = _parking()
    parking.park([torch.ones(3)])
    parking.restore()
    event = object()
    parking._pending = event  # as a background restore leaves it
    parking.park([])
    assert waited == [event] and not parking.pending
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_background_restore_gives_the_same_bytes_once_the_current_stream_waits():
    """256 MiB of fp32 state parked, the freed device memory overwritten with NaN, then restored on a side stream held
    back ~1 s (so the copies are provably still in flight when the reads are queued): after :meth:`HostParking.wait`,
    reads on the current stream see exactly the parked bytes; without the wait they would see the NaN."""
    state = [torch.randn(16 << 20, device="cuda") for _ in range(4)]
    want = [t.clone() for t in state]
    parking = HostParking(pin=True)
    parking.park(state)
    assert all(t.untyped_storage().nbytes() == 0 for t in state)
    poison = [torch.full((16 << 20,), float("nan"), device="cuda") for _ in range(4)]  # the blocks the park freed
    del poison  # cached, taken again by the restore's allocations
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 31)
    parking.restore(stream=side)
    assert parking.pending and not parking.parked
    assert not parking._pending.query()  # the copies have not landed yet
    parking.wait()
    got = [t.clone() for t in state]  # queued after the wait
    torch.cuda.synchronize()
    assert not parking.pending
    assert all(torch.equal(g, w) for g, w in zip(got, want))
