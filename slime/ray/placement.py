"""Ray start-up and placement groups: where trainer ranks and rollout engines run.

:func:`init_ray` starts a local Ray instance or joins a cluster (``--ray-address``), which slime then
never stops.  :func:`create_placement_groups` reserves one bundle per trainer rank and per rollout
GPU (one GPU + 1 CPU; one CPU on machines without GPUs, so the same flags size the run).
``--colocate`` puts trainers and engines on the same bundles (fractional GPU requests, upstream
slime's 0.4 / 0.2); else they get disjoint ones.  An engine spans ``--rollout-num-gpus-per-engine``
bundles: its actor sits on the first and is told all of them (:class:`EngineResources`), found by a
probe task per bundle and sorted by (node, GPU id), so that an engine's GPUs are neighbours on one node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.errors import SlimeError
from slime.ray.config import ClusterConfig
from slime.rollout.engines.base import BundleResources, EngineResources

logger = logging.getLogger(__name__)

# Fractions of one GPU requested by colocated actors (upstream slime's split); only Ray's
# bookkeeping, the processes themselves see the whole GPU.
COLOCATED_TRAINER_GPU = 0.4
COLOCATED_ENGINE_GPU = 0.2


class PlacementError(SlimeError, RuntimeError):
    """The Ray cluster cannot host the requested trainer ranks and rollout engines."""


class RayAddressError(SlimeError, ConnectionError):
    """``--ray-address`` names no Ray cluster that this process can join; the message names the address."""


def init_ray(cluster: ClusterConfig, *, extra_env: dict[str, str] | None = None) -> bool:
    """Start or join Ray: ``--ray-address`` None starts a local instance, ``"auto"`` or ``host:port`` joins one.

    ``extra_env``: environment of every Ray worker.  Returns True when this process started Ray (and must stop it).
    Raises RayAddressError: ``--ray-address`` is given and no Ray cluster there can be joined.
    """
    env = {"PYTHONPATH": os.pathsep.join(p for p in [_repo_root(), os.environ.get("PYTHONPATH", "")] if p)}
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "WANDB_MODE", "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        if key in os.environ:
            env[key] = os.environ[key]
    env.update(extra_env or {})
    runtime_env = {"env_vars": env}
    if cluster.ray_address:
        _check_reachable(cluster.ray_address)
        try:
            with _keep_sigterm_handler():
                ray.init(address=cluster.ray_address, runtime_env=runtime_env, log_to_driver=True)
        except (ConnectionError, RuntimeError) as e:
            raise RayAddressError(
                f"--ray-address {cluster.ray_address}: cannot join the Ray cluster ({e}). Check that it runs "
                "(`ray status`), that RAY_ADDRESS / --ray-address point at its head, and that both sides use the "
                "same Ray version and authentication settings (RAY_AUTH_MODE)"
            ) from e
        logger.info("joined Ray cluster at %s: %s", cluster.ray_address, ray.cluster_resources())
        return False
    num_trainers = cluster.actor_num_nodes * cluster.actor_num_gpus_per_node
    num_engines_gpus = cluster.rollout_num_gpus or 0
    with _keep_sigterm_handler():
        ray.init(
            # Always a new local instance: never join a cluster that RAY_ADDRESS or a stale
            # /tmp/ray/ray_current_cluster file points at (joining is --ray-address's job).
            address="local",
            # Logical CPUs: at least one per actor even on a 2-core machine; torch threads
            # are set per actor from the real core count (see ``cpu_threads_per_actor``).
            num_cpus=max(os.cpu_count() or 1, num_trainers + num_engines_gpus + 1),
            include_dashboard=False,
            runtime_env=runtime_env,
            log_to_driver=True,
            # The default (30% of RAM) is far more than rollout batches need.
            object_store_memory=int(os.environ.get("SLIME_RAY_OBJECT_STORE_BYTES", 1 << 30)),
        )
    return True


@contextlib.contextmanager
def _keep_sigterm_handler():
    """Keep this process's SIGTERM handler across ``ray.init``, which installs its own in the driver
    (``sys.exit(15)``).  The run's handler is the one the launcher and README promise (``slime.train``: the first
    SIGTERM raises ``SystemExit(143)``, a second kills at once); under Ray's, a run stopped by SIGTERM exited 15, and a
    second SIGTERM raised again wherever the interpreter stood (inside an ``ActorHandle.__del__`` it is printed as
    "Exception ignored" and lost).  Only the main thread sets handlers; from another thread nothing is kept."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def cluster_num_gpus() -> int:
    """Number of GPUs Ray sees in the whole cluster."""
    return int(ray.cluster_resources().get("GPU", 0))


def cpu_threads_per_actor(num_actors: int) -> int:
    """torch intra-op threads for each of ``num_actors`` CPU actors sharing this machine."""
    return max(1, (os.cpu_count() or 1) // max(1, num_actors))


NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Ray's switch that leaves ``CUDA_VISIBLE_DEVICES`` of an actor alone (set to ``"1"`` for engines,
which set it themselves to all their bundles' GPUs, see :class:`EngineResources`)."""


@dataclasses.dataclass
class Placement:
    """Reserved resources for one run.

    Attributes:
        trainer_pg / trainer_bundles: the trainers' placement group and each rank's bundle index.
        engine_pg: the engines' placement group (the trainers' one when colocated).
        engine_resources: per engine, every bundle it spans with its node and GPU ids (actor on the first).
    """

    use_gpu: bool
    colocate: bool
    trainer_pg: PlacementGroup
    trainer_bundles: list[int]
    engine_pg: PlacementGroup
    engine_resources: list[EngineResources]
    _removed: bool = dataclasses.field(default=False, repr=False)

    @property
    def num_trainers(self) -> int:
        return len(self.trainer_bundles)

    @property
    def num_engines(self) -> int:
        return len(self.engine_resources)

    @property
    def engine_bundles(self) -> list[list[int]]:
        """Per engine, the bundle indices it spans."""
        return [r.bundle_indices for r in self.engine_resources]

    def trainer_options(self, rank: int) -> dict:
        """``.options(...)`` for trainer rank ``rank``."""
        gpu = (COLOCATED_TRAINER_GPU if self.colocate else 1) if self.use_gpu else 0
        return dict(
            num_cpus=0.5 if self.colocate else 1,
            num_gpus=gpu,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.trainer_pg, self.trainer_bundles[rank]),
        )

    def engine_options(self, index: int) -> dict:
        """``.options(...)`` for the actor of engine ``index`` (on GPUs it sets ``CUDA_VISIBLE_DEVICES`` itself)."""
        gpu = (COLOCATED_ENGINE_GPU if self.colocate else 1) if self.use_gpu else 0
        options = dict(
            num_cpus=0.5 if self.colocate else 1,
            num_gpus=gpu,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.engine_pg, self.engine_resources[index].bundles[0].bundle_index
            ),
        )
        if self.use_gpu:
            options["runtime_env"] = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
        return options

    def remove(self) -> None:
        """Give the bundles back to the cluster at once (idempotent; logs, never raises: it runs during clean-up)."""
        if self._removed:
            return
        self._removed = True
        for pg in dict.fromkeys([self.engine_pg, self.trainer_pg]):
            try:
                ray.util.remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - clean-up must go on
                logger.warning("could not remove placement group %s: %s", pg.id.hex(), e)


def create_placement_groups(cluster: ClusterConfig, *, use_gpu: bool, timeout_s: float = 600) -> Placement:
    """Reserve the bundles of trainers and engines, wait until Ray grants them, and probe where each engine's are.

    Raises:
        PlacementError: at once when the cluster's total resources are too few, or when Ray cannot
            grant them within ``timeout_s``; the message lists what was asked and what the cluster has.
    """
    num_trainers = cluster.actor_num_nodes * cluster.actor_num_gpus_per_node
    gpus_per_engine = cluster.rollout_num_gpus_per_engine
    unit = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    _check_cluster_fits(num_trainers if cluster.colocate else num_trainers + cluster.rollout_num_gpus, unit, cluster)
    trainer_pg = _reserve([dict(unit) for _ in range(num_trainers)], "PACK", timeout_s)
    if cluster.colocate:
        engine_pg, num_rollout = trainer_pg, num_trainers
    else:
        try:
            engine_pg = _reserve([dict(unit) for _ in range(cluster.rollout_num_gpus)], "PACK", timeout_s)
        except BaseException:
            ray.util.remove_placement_group(trainer_pg)
            raise
        num_rollout = cluster.rollout_num_gpus
    total_bundles = num_trainers + (0 if cluster.colocate else num_rollout)
    probed = _probe_bundles(engine_pg, num_rollout, unit)
    engine_resources = [
        EngineResources(
            index=i,
            bundles=bundles,
            use_gpu=use_gpu,
            colocated=cluster.colocate,
            cpu_threads=None if use_gpu else cpu_threads_for_bundles(gpus_per_engine, total_bundles),
        )
        for i, bundles in enumerate(assign_engine_bundles(probed, gpus_per_engine))
    ]
    for resources in engine_resources:
        if len(resources.node_ips) > 1:
            logger.warning("rollout %s spans several nodes", resources.describe())
    logger.info(
        "placement: %d trainer rank(s), %d engine(s) x %d %s, %s; %s",
        num_trainers, len(engine_resources), gpus_per_engine, "GPU" if use_gpu else "CPU bundle",
        "colocated" if cluster.colocate else "disaggregated", "; ".join(r.describe() for r in engine_resources),
    )
    return Placement(use_gpu, cluster.colocate, trainer_pg, list(range(num_trainers)), engine_pg, engine_resources)


def cpu_threads_for_bundles(num_bundles: int, total_bundles: int) -> int:
    """torch threads of an actor on ``num_bundles`` of ``total_bundles`` CPU bundles: its share of the cores (>= 1)."""
    return max(1, (os.cpu_count() or 1) * num_bundles // max(1, total_bundles))


@ray.remote(num_cpus=0)
def _bundle_location() -> tuple[str, str, list]:
    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()


def _probe_bundles(pg: PlacementGroup, num_bundles: int, unit: dict[str, float]) -> list[BundleResources]:
    """Where each of the first ``num_bundles`` bundles is, from a probe task in it (a GPU sliver: told the GPU id)."""
    gpus = 0.01 if unit.get("GPU") else 0
    refs = [
        _bundle_location.options(num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
        for i in range(num_bundles)
    ]
    return [
        BundleResources(i, ip, node_id, tuple(str(g) for g in gpu_ids), float(unit["CPU"]))
        for i, (ip, node_id, gpu_ids) in enumerate(ray.get(refs))
    ]


def assign_engine_bundles(bundles: list[BundleResources], per_engine: int) -> list[tuple[BundleResources, ...]]:
    """Cut the probed bundles into engines of ``per_engine`` consecutive bundles, sorted by node, GPU id, index."""

    def device_order(bundle: BundleResources) -> tuple:
        gpus = tuple((0, int(g), "") if g.isdigit() else (1, 0, g) for g in bundle.gpu_ids)
        return bundle.node_ip, bundle.node_id, gpus, bundle.bundle_index

    ordered = sorted(bundles, key=device_order)
    return [tuple(ordered[start : start + per_engine]) for start in range(0, len(ordered), per_engine)]


def _check_cluster_fits(num_bundles: int, unit: dict[str, float], cluster: ClusterConfig) -> None:
    total = ray.cluster_resources()
    short = {k: (v * num_bundles, total.get(k, 0)) for k, v in unit.items() if v * num_bundles > total.get(k, 0)}
    if short:
        asked = ", ".join(f"{need:g} {k} (cluster total {have:g})" for k, (need, have) in short.items())
        trainers = cluster.actor_num_gpus
        engines = f"--rollout-num-gpus {cluster.rollout_num_gpus}"
        if cluster.colocate:
            engines = "shared with the trainers (--colocate)"
        raise PlacementError(
            f"the Ray cluster is too small for this run: it needs {asked} for {trainers} trainer rank(s) "
            f"(--actor-num-nodes {cluster.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{cluster.actor_num_gpus_per_node}) and rollout bundles {engines}. Lower those flags, use --colocate, "
            "or add nodes"
        )


def _reserve(bundles: list[dict], strategy: str, timeout_s: float) -> PlacementGroup:
    pg = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not reserve {len(bundles)} bundle(s) of {bundles[0]} within {timeout_s:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}. Lower --actor-num-gpus-per-node / --rollout-num-gpus "
            f"or add nodes."
        )
    return pg


CPU_ACTOR_BASE_BYTES = 512 << 20
"""Resident memory of one idle CPU actor process (Python + torch + transformers), about 0.5 GiB."""


def host_memory_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_cpu_memory(cluster: ClusterConfig, weights_bytes: int) -> None:
    """Without GPUs, refuse a layout whose actor processes cannot fit in RAM (rather than Ray's OOM killer later).

    Bound per actor: :data:`CPU_ACTOR_BASE_BYTES` plus one float32 copy of the weights (``2 * weights_bytes``
    for bf16).

    Raises:
        PlacementError: the bound exceeds ``MemAvailable``; names the flags and both figures.
    """
    available = host_memory_available()
    num_actors = cluster.actor_num_gpus + cluster.num_rollout_engines  # colocated or not: separate processes
    need = num_actors * (CPU_ACTOR_BASE_BYTES + 2 * weights_bytes)
    if available is not None and need > available:
        gib = 1 << 30
        raise PlacementError(
            f"no GPUs here, so every trainer rank and engine is a CPU process: {num_actors} of them "
            f"({cluster.actor_num_gpus} trainer ranks = --actor-num-nodes x --actor-num-gpus-per-node, "
            f"{cluster.num_rollout_engines} engines = --rollout-num-gpus / --rollout-num-gpus-per-engine) need at "
            f"least {need / gib:.1f} GiB, and {available / gib:.1f} GiB of RAM "
            "is available. Use fewer ranks (e.g. --actor-num-gpus-per-node 2 --rollout-num-gpus 1)"
        )


RAY_CURRENT_CLUSTER_FILE = "/tmp/ray/ray_current_cluster"
"""Where ``ray start --head`` writes the head's GCS address, read by ``address="auto"``."""


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Fail fast when the Ray head's GCS port is unreachable (``ray.init`` retries for ever).

    Raises:
        RayAddressError: no TCP connection within ``timeout_s``, naming ``--ray-address`` and the address.
    """
    resolved = address
    if address == "auto":
        resolved = os.environ.get("RAY_ADDRESS", "")
        if not resolved or resolved == "auto":
            try:
                with open(RAY_CURRENT_CLUSTER_FILE) as f:
                    resolved = f.read().strip()
            except OSError:
                return  # Ray says "no running cluster found" itself, at once
    host, sep, port = resolved.rpartition(":")
    if "://" in resolved or not sep or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        via = "" if resolved == address else f" (resolved to {resolved})"
        raise RayAddressError(
            f"--ray-address {address}{via}: no Ray head answers at {resolved} ({e}). Start one with "
            "`ray start --head`, or fix the address (RAY_ADDRESS / --ray-address; `ray status` on the head prints it)"
        ) from None


def free_port() -> int:
    """An unused TCP port on this host (for a torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    """This node's IP address as Ray knows it."""
    return ray.util.get_node_ip_address()


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
