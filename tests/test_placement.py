"""Placement groups on a real local Ray with 4 logical CPUs and no GPUs (CPU bundles).

Expected bundle layouts are worked out by hand from the flags (see
:func:`slime.ray.placement.create_placement_groups`).
"""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group_table

from slime.ray.config import ClusterConfig
from slime.ray.placement import PlacementError, create_placement_groups


@pytest.fixture(scope="module")
def four_cpu_ray():
    """Exactly 4 logical CPUs whatever the machine (the CPU-count checks below count on it), unlike ``local_ray``."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=100 << 20)
    yield
    ray.shutdown()


def _bundles(pg) -> list[dict]:
    table = placement_group_table(pg)
    return [table["bundles"][i] for i in sorted(table["bundles"])]


def test_disaggregated_gets_separate_bundles(four_cpu_ray):
    # 1 node x 2 trainer ranks; 2 rollout "GPUs", 1 per engine -> 2 engines on their own group.
    cluster = ClusterConfig(actor_num_nodes=1, actor_num_gpus_per_node=2, rollout_num_gpus=2)
    placement = create_placement_groups(cluster, use_gpu=False)
    try:
        assert not placement.colocate and placement.trainer_pg != placement.engine_pg
        assert placement.trainer_bundles == [0, 1] and placement.engine_bundles == [[0], [1]]
        assert _bundles(placement.trainer_pg) == [{"CPU": 1.0}] * 2
        assert _bundles(placement.engine_pg) == [{"CPU": 1.0}] * 2
        assert placement.trainer_options(1)["num_cpus"] == 1 and placement.trainer_options(1)["num_gpus"] == 0
        # Each engine is told where its bundle is (probed inside it): this node, no GPU, 1 CPU.
        for index, resources in enumerate(placement.engine_resources):
            assert resources.index == index and not resources.use_gpu and not resources.colocated
            here = ray.util.get_node_ip_address()
            assert [(b.node_ip, b.gpu_ids, b.num_cpus) for b in resources.bundles] == [(here, (), 1.0)]
        assert "runtime_env" not in placement.engine_options(0)  # CPU engines: nothing for Ray to leave alone
    finally:
        placement.remove()
        placement.remove()  # idempotent
        assert {pg["state"] for pg in placement_group_table().values()} == {"REMOVED"}


def test_colocated_engines_share_the_trainer_bundles(four_cpu_ray):
    # 4 trainer ranks, engines of 2 "GPUs" each on the same 4 bundles -> engines start at bundles 0 and 2.
    cluster = ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus_per_engine=2, colocate=True)
    placement = create_placement_groups(cluster, use_gpu=False)
    try:
        assert placement.colocate and placement.trainer_pg == placement.engine_pg
        assert placement.trainer_bundles == [0, 1, 2, 3] and placement.engine_bundles == [[0, 1], [2, 3]]
        assert _bundles(placement.trainer_pg) == [{"CPU": 1.0}] * 4
        assert all(r.colocated for r in placement.engine_resources)
        # Half a CPU each, so a trainer rank and an engine fit in one bundle; the engine's actor goes
        # on its first bundle.
        assert placement.trainer_options(3)["num_cpus"] == 0.5 and placement.engine_options(1)["num_cpus"] == 0.5
        assert placement.engine_options(1)["scheduling_strategy"].placement_group_bundle_index == 2
    finally:
        placement.remove()


def test_too_small_cluster_fails_at_once_naming_the_flags(four_cpu_ray):
    # 3 trainer + 2 engine bundles = 5 CPUs > 4: refused before any placement group is made.
    cluster = ClusterConfig(actor_num_gpus_per_node=3, rollout_num_gpus=2)
    with pytest.raises(PlacementError) as info:
        create_placement_groups(cluster, use_gpu=False, timeout_s=1)
    message = str(info.value)
    assert "needs 5 CPU (cluster total 4)" in message
    assert "--actor-num-gpus-per-node 3" in message and "--rollout-num-gpus 2" in message
    assert placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in placement_group_table().values()
    )


def test_bundles_held_by_another_job_time_out_with_placement_error(four_cpu_ray):
    from ray.util.placement_group import placement_group

    other_job = placement_group([{"CPU": 1}] * 4)
    ray.get(other_job.ready(), timeout=30)
    try:
        with pytest.raises(PlacementError, match=r"could not reserve 2 bundle\(s\) of \{'CPU': 1\} within 1s"):
            create_placement_groups(ClusterConfig(actor_num_gpus_per_node=2, colocate=True), use_gpu=False, timeout_s=1)
    finally:
        ray.util.remove_placement_group(other_job)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


def test_unreachable_ray_address_fails_in_seconds(monkeypatch):
    import time

    from slime.ray import placement

    port = _closed_port()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"--ray-address 127\.0\.0\.1:{port}: no Ray head answers"):
        placement.init_ray(ClusterConfig(rollout_num_gpus=1, ray_address=f"127.0.0.1:{port}"))
    assert time.monotonic() - started < 15  # ray.init alone would retry for ever

    # "auto" resolves through RAY_ADDRESS, and the message says so.
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConnectionError, match=rf"--ray-address auto \(resolved to 127\.0\.0\.1:{port}\)"):
        placement.init_ray(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1, ray_address="auto"))


def test_cpu_layout_that_cannot_fit_in_ram_is_refused(monkeypatch):
    from slime.ray import placement

    gib = 1 << 30
    monkeypatch.setattr(placement, "host_memory_available", lambda: 24 * gib)
    # 64 trainer ranks + 64 one-"GPU" engines, 0.1 GiB of weights: 128 x (0.5 + 0.2) GiB = 89.6 GiB > 24 GiB.
    big = ClusterConfig(actor_num_gpus_per_node=64, rollout_num_gpus=64)
    with pytest.raises(PlacementError) as info:
        placement.check_cpu_memory(big, weights_bytes=gib // 10)
    message = str(info.value)
    assert "128 of them (64 trainer ranks" in message and "64 engines" in message
    assert "need at least 89.6 GiB, and 24.0 GiB of RAM is available" in message
    # 2 ranks + 1 engine of the same model: 3 x 0.7 = 2.1 GiB fits.
    placement.check_cpu_memory(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=1), weights_bytes=gib // 10)
    # Colocated on CPU, engines are still processes of their own: 8 ranks + 4 engines of 2 "GPUs".
    colocated = ClusterConfig(actor_num_gpus_per_node=8, rollout_num_gpus_per_engine=2, colocate=True)
    monkeypatch.setattr(placement, "host_memory_available", lambda: int(11.9 * 0.5 * gib))
    with pytest.raises(PlacementError, match="12 of them"):
        placement.check_cpu_memory(colocated, weights_bytes=0)


def test_host_memory_available_reads_meminfo():
    from slime.ray.placement import host_memory_available

    with open("/proc/meminfo") as f:
        expected = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(host_memory_available() - expected) < 256 << 20  # it moves a little between the reads


def test_engines_take_neighbouring_gpus_of_one_node_whatever_the_bundle_numbering():
    from slime.ray.placement import COLOCATED_ENGINE_GPU, NOSET_CUDA_VISIBLE_DEVICES, Placement, assign_engine_bundles
    from slime.rollout.engines.base import BundleResources, EngineResources

    # Two nodes of 4 GPUs, bundles numbered by Ray in no particular order; GPU ids "10" and "2"
    # sort as numbers. By hand: node A holds bundles 5 (GPU 2), 1 (GPU 10), 3 (GPU 0), 6 (GPU 1);
    # node B bundles 0, 2, 4, 7 with GPUs 3, 1, 0, 2.
    layout = {0: ("10.0.0.2", "3"), 1: ("10.0.0.1", "10"), 2: ("10.0.0.2", "1"), 3: ("10.0.0.1", "0"),
              4: ("10.0.0.2", "0"), 5: ("10.0.0.1", "2"), 6: ("10.0.0.1", "1"), 7: ("10.0.0.2", "2")}
    bundles = [BundleResources(i, ip, f"node-{ip}", (gpu,), 1.0) for i, (ip, gpu) in layout.items()]
    engines = assign_engine_bundles(bundles, per_engine=2)
    assert [[b.bundle_index for b in engine] for engine in engines] == [[3, 6], [5, 1], [4, 2], [7, 0]]

    resources = [EngineResources(i, engine, use_gpu=True, colocated=True) for i, engine in enumerate(engines)]
    assert resources[1].gpu_ids == ["2", "10"] and resources[1].local_cuda_visible_devices == "2,10"
    assert resources[2].node_ip == "10.0.0.2" and resources[2].num_gpus == 2
    assert resources[1].describe() == "engine 1 (node 10.0.0.1, bundles [5, 1], GPUs 2,10)"

    # The engine actor goes on its first bundle, with a fraction of its GPU (colocated) and Ray told
    # to leave CUDA_VISIBLE_DEVICES to it.
    placement = Placement(use_gpu=True, colocate=True, trainer_pg=None, trainer_bundles=list(range(8)),
                          engine_pg=None, engine_resources=resources)
    options = placement.engine_options(1)
    assert options["scheduling_strategy"].placement_group_bundle_index == 5
    assert options["num_gpus"] == COLOCATED_ENGINE_GPU
    assert options["runtime_env"] == {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}

    # An engine larger than a node spans both; the GPUs of its actor's node are the local ones.
    (big,) = assign_engine_bundles(bundles, per_engine=8)
    spanning = EngineResources(0, big, use_gpu=True)
    assert spanning.node_ips == ["10.0.0.1", "10.0.0.2"]
    assert spanning.local_cuda_visible_devices == "0,1,2,10" and spanning.num_gpus == 8


def test_starting_ray_keeps_the_runs_sigterm_handler():
    """``ray.init`` installs its own SIGTERM handler in the driver (``sys.exit(15)``); ``init_ray`` puts the run's back,
    so a stopped run exits 143 through ``slime.train``'s handler (a second SIGTERM kills at once).  In a fresh
    interpreter: this module's other tests hold a Ray instance."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import signal, ray
        from slime.ray import placement
        from slime.ray.config import ClusterConfig
        def runs_handler(signum, frame):
            pass
        signal.signal(signal.SIGTERM, runs_handler)
        assert placement.init_ray(ClusterConfig(rollout_num_gpus=1)) is True
        kept = signal.getsignal(signal.SIGTERM) is runs_handler
        ray.shutdown()
        print("kept" if kept else "replaced")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "kept"
