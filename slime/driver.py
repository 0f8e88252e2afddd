"""The GRPO run: :func:`train` sets up engines, trainers and the rollout manager and runs the rollout steps.

One rollout step, in the algorithm's order::

    generate (n samples per prompt) -> reward -> group advantages   [rollout manager]
    train on the global batch (optimizer steps x micro-batches)     [trainer ranks]
    sync weights to the engines                                     [trainers -> engines]
    eval every --eval-interval, save every --save-interval

With ``--colocate`` on GPUs, :class:`ColocatedMemory` hands the GPU memory over between the engines and the
trainers around the training and the sync.
Where processes run, which backend trains and which engine samples are hidden in the
worker groups (:mod:`slime.ray`, :mod:`slime.ray.engine_group`); this file contains
no backend or engine details.  The command line is :mod:`slime.train`, which imports this
module only once the flags are good (so ``--help`` and a usage error need no Ray or torch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import ray
import torch

from slime.arguments import SlimeConfig, check_resources, config_to_argv
from slime.backends.registry import TRAIN_BACKENDS
from slime.backends.weight_sources import resolve_weights
from slime.checkpoints import layout as ckpt
from slime.checkpoints.hf import read_config, weights_bytes
from slime.data.processor import load_processor
from slime.data.sources import load_table
from slime.grpo.advantages import resolve_advantage_estimator
from slime.grpo.correction import tis_function
from slime.grpo.loss import pg_loss_reducer
from slime.ray.engine_group import RolloutEngineGroup
from slime.ray.placement import Placement, check_cpu_memory, cluster_num_gpus, create_placement_groups, init_ray
from slime.ray.trainer_group import TrainerGroup
from slime.rollout.engines import ENGINES
from slime.rollout.engines.base import GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPES
from slime.rollout.filters import resolve_filter
from slime.rollout.manager import RolloutManager
from slime.rollout.parity import EngineParityCheck
from slime.rollout.replay import check_saved_rollouts, model_fingerprint
from slime.rollout.rm_hub.config import resolve_reward_function
from slime.utils.config import ConfigError
from slime.utils.env_check import check_environment
from slime.utils.metrics import METRICS_FILE, PLOT_FILE, MetricsLogger, progress, truncate_metrics
from slime.utils.timer import PhaseClock, step_line, timed, token_rates
from slime.weight_sync import make_transport
from slime.weight_sync.fused_experts import checkpoint_num_experts

logger = logging.getLogger("slime")


def train(cfg: SlimeConfig, on_start: Callable[[], object] | None = None) -> Path:
    """Run GRPO as configured; returns the run directory (metrics.jsonl, reward_curve.png).

    Whatever ends the run (success, an error, Ctrl-C), the engines (and every process they
    started), the trainer ranks, the placement groups and the reward workers are stopped
    before this returns or raises, also on a Ray cluster joined with ``--ray-address``, which
    itself keeps running.  Clean-up problems are logged and never replace the original error.

    Args:
        cfg: the run's flags.
        on_start: called once everything is set up, just before the first rollout step.

    Raises:
        ConfigError: the ``--rollout-backend``, ``--train-backend``, ``--advantage-estimator`` or
            reward function cannot be loaded here (checked before anything starts, :func:`resolve_components`).
    """
    components = resolve_components(cfg)
    rollout_manager = prepare(cfg)
    run_dir = make_run_dir(cfg)
    started_ray = init_ray(cfg.cluster)
    with contextlib.ExitStack() as cleanup:  # callbacks run last-registered first
        if started_ray:
            cleanup.callback(_quietly, ray.shutdown, "stopping Ray")
        cleanup.callback(_quietly, rollout_manager.close, "stopping the reward workers")
        run = setup(cfg, components, rollout_manager, cleanup)
        if on_start is not None:
            on_start()
        with MetricsLogger(run_dir, cfg.wandb, run_name=run_dir.name,
                           config={"argv": config_to_argv(cfg, redact=True)}) as metrics_log:
            loop(cfg, run, metrics_log)
        logger.info("done: metrics in %s, reward curve in %s", run_dir / METRICS_FILE, run_dir / PLOT_FILE)
        return run_dir


def _quietly(action, what: str) -> None:
    """Run a clean-up ``action``; log instead of raise, so the error that ended the run stays the one raised."""
    try:
        action()
    except Exception as e:  # noqa: BLE001
        logger.warning("%s failed: %s", what, e)


def loop(cfg: SlimeConfig, run: Run, metrics_log: MetricsLogger) -> None:
    """The rollout steps ``run.start .. run.num_rollout - 1`` (metrics x axis: policy version).

    Rollout ``k`` samples the policy after ``k`` updates and is logged at step ``k``; the
    eval after it sees the policy after ``k + 1`` updates and is logged at step ``k + 1``.
    """
    rollout_manager, trainers, engines, memory = run.rollout_manager, run.trainers, run.engines, run.memory
    if run.start == 0 and engines is not None and cfg.eval.eval_prompt_pairs and not cfg.eval.skip_eval_before_train:
        metrics_log.log(0, rollout_manager.evaluate(0))
    bar = progress(total=run.num_rollout, initial=run.start, disable=cfg.logging.no_progress_bar)
    for rollout_id in range(run.start, run.num_rollout):
        times: dict[str, float] = {}
        with timed("rollout", times):
            # The first two steps only; first, so that an engine the probe refuses costs no rollout.
            parity_probe = run.parity.generate(engines, rollout_id)
            batch = rollout_manager.generate(rollout_id)
        parity_metrics, train_metrics = {}, {}
        if trainers is not None:  # None: --debug-rollout-only
            clock = PhaseClock("train")  # the trainers' own sub-phases come back in train_metrics
            with timed("train", times), memory.train_phase(clock):
                with clock("parity"):
                    parity_metrics = run.parity.compare(trainers, parity_probe, rollout_id)
                train_metrics = trainers.train(rollout_id, batch.samples)
            times.update(clock.metrics())
        if trainers is not None and engines is not None:  # engines None: --load-debug-rollout-data
            clock = PhaseClock("sync")
            with timed("sync", times), memory.sync_phase(clock):
                with clock("push"):
                    trainers.update_weights(engines)
            times.update(clock.metrics())
        eval_metrics = {}
        if (engines is not None and cfg.eval.eval_prompt_pairs
                and _due(rollout_id, cfg.eval.eval_interval, run.num_rollout)):
            with timed("eval", times):
                eval_metrics = rollout_manager.evaluate(rollout_id + 1)
        saving = (trainers is not None and cfg.checkpoint.save
                  and _due(rollout_id, cfg.checkpoint.save_interval, run.num_rollout))
        if saving:
            with timed("save", times):
                save(cfg, rollout_id, trainers, rollout_manager)
        step_metrics = {**batch.metrics, **parity_metrics, **train_metrics, **memory.metrics(), **run.engine_metrics(),
                        **run.sync_metrics(), **times}
        if trainers is not None:
            step_metrics.update(token_rates(sum(len(s.prompt_token_ids) + s.response_length for s in batch.samples), step_metrics))
        metrics_log.log(rollout_id, step_metrics)
        logger.info("%s", step_line(rollout_id, step_metrics))
        if eval_metrics:
            metrics_log.log(rollout_id + 1, eval_metrics)
        if saving:  # only now: a run killed before this resumes at (and re-logs) this step
            ckpt.mark_latest(cfg.checkpoint.save, rollout_id)
        bar.update({**step_metrics, **eval_metrics})
    bar.close()


@dataclasses.dataclass
class Run:
    """Everything :func:`loop` drives, built by :func:`setup`."""

    engines: RolloutEngineGroup | None  # None: --load-debug-rollout-data (train-only replay)
    trainers: TrainerGroup | None  # None: --debug-rollout-only
    rollout_manager: RolloutManager
    memory: ColocatedMemory
    start: int
    num_rollout: int
    parity: EngineParityCheck = dataclasses.field(default_factory=EngineParityCheck.off)

    def engine_metrics(self) -> dict[str, float]:
        """``rollout/engine_failures``, ``rollout/requests_retried``, ``rollout/engines_restarted``,
        ``rollout/mid_rollout_resyncs`` (run totals)."""
        if not isinstance(self.engines, RolloutEngineGroup):
            return {}
        return {f"rollout/{name}": float(self.engines.fault_counts[name])
                for name in ("engine_failures", "requests_retried", "engines_restarted", "mid_rollout_resyncs")}

    def sync_metrics(self) -> dict[str, float]:
        """The weight sync's counts since the last step (:meth:`TrainerGroup.sync_metrics`)."""
        return self.trainers.sync_metrics() if isinstance(self.trainers, TrainerGroup) else {}


# ------------------------------------------------------------------------------------ the colocated hand-over
# Per rollout step, so that optimizer state and KV cache are never on the GPU together (``--colocate`` on GPU)::
#
#     train_phase: 1. engines release everything; trainers onload   2. train
#                  3. trainers offload all but the policy weights
#     sync_phase:  4. engines resume their weights; the push   5. trainers offload their weights
#                  6. engines resume KV cache and CUDA graphs
#
# Peak during the sync: trainer weights + engine weights.  Start-up, the mid-rollout re-sync and the sources
# (upstream slime's ``--offload`` loop over SGLang's memory-saver tags): ``docs/design/colocate.md``; a trainer
# rank's half: :mod:`slime.backends.handover`.

RELEASED_FOR_TRAINING = GPU_MEMORY_TYPES
"""Step 1: every engine memory region."""
RESUMED_FOR_SYNC = (GPU_MEMORY_TYPE_WEIGHTS,)
"""Step 4: what the weight push writes into."""
RESUMED_AFTER_SYNC = tuple(tag for tag in GPU_MEMORY_TYPES if tag != GPU_MEMORY_TYPE_WEIGHTS)
"""Step 6: the rest (KV cache, CUDA graphs)."""


class ColocatedMemory:
    """The hand-over above, as context managers around start-up, training, the sync and a mid-rollout re-sync.

    ``enabled`` False: no calls at all.  ``measure``: record the engines' free GPU memory around each
    release (:meth:`metrics`).  A :meth:`sync_phase` without a preceding release resumes nothing.
    """

    def __init__(self, trainers: TrainerGroup, engines: RolloutEngineGroup, enabled: bool, measure: bool = False):
        self.trainers, self.engines, self.enabled = trainers, engines, enabled
        self.measure = measure and enabled
        self._engines_released = False  # step 1 ran and step 6 has not yet
        self._figures: dict[str, float] = {}

    def metrics(self) -> dict[str, float]:
        """The figures since the last call, GiB per GPU: ``memory/free_gib_engines_resident`` and ``..._released``."""
        figures, self._figures = self._figures, {}
        return figures

    def _release_engines(self, measure: bool = True) -> None:
        """Step 1; with ``measure`` (and ``self.measure``) the engines' fullest GPU's free memory before and after,
        GiB, as metrics ``memory/free_gib_engines_resident`` and ``..._released``."""
        if not self._engines_released:
            figures = self.engines.release_memory(list(RELEASED_FOR_TRAINING), measure=measure and self.measure)
            self._engines_released = True
            if figures is not None:
                self._figures.update(zip(("memory/free_gib_engines_resident", "memory/free_gib_engines_released"),
                                         figures))

    @contextlib.contextmanager
    def startup_phase(self) -> Iterator[None]:
        """Around the trainers' initialisation: engines out first; afterwards only the trainers' weights stay."""
        if self.enabled:
            self._release_engines()
        yield  # the trainers load the model, optimizer and any --load checkpoint
        if self.enabled:
            self.trainers.offload(keep_weights=True)

    @contextlib.contextmanager
    def train_phase(self, clock: PhaseClock | None = None) -> Iterator[None]:
        """Steps 1-3; with ``clock``, their times as its ``engine_release``, ``onload`` and ``offload`` sub-phases."""
        clock = clock or PhaseClock("train")
        if self.enabled:
            with clock("engine_release"):
                self._release_engines()  # 1
            with clock("onload"):
                self.trainers.onload()
        yield  # 2. train
        if self.enabled:
            with clock("offload"):
                self.trainers.offload(keep_weights=True)  # 3

    @contextlib.contextmanager
    def sync_phase(self, clock: PhaseClock | None = None) -> Iterator[None]:
        """Steps 4-6; with ``clock``, their times as its ``engine_resume`` (4 and 6) and ``offload`` (5) sub-phases."""
        clock = clock or PhaseClock("sync")
        resume = self._engines_released  # only ever set when enabled
        if resume:
            with clock("engine_resume"):
                self.engines.resume_memory_occupation(list(RESUMED_FOR_SYNC))  # 4
        yield  # 4. push the weights
        if self.enabled:
            with clock("offload"):
                self.trainers.offload()  # 5
        if resume:
            with clock("engine_resume"):
                self.engines.resume_memory_occupation(list(RESUMED_AFTER_SYNC))  # 6
            self._engines_released = False

    @contextlib.contextmanager
    def resync_phase(self) -> Iterator[None]:
        """Around a push mid-rollout: step 1, the trainers' weights only in, then steps 4-6; nothing is measured."""
        if self.enabled:
            self._release_engines(measure=False)  # 1
            self.trainers.onload(weights_only=True)  # the state step 3 leaves
        with self.sync_phase():  # 4-6
            yield


@dataclasses.dataclass
class Components:
    """The classes a run uses, resolved from ``--rollout-backend`` and ``--train-backend``."""

    engine_cls: type
    backend_cls: type


def resolve_components(cfg: SlimeConfig) -> Components:
    """Look up (and import) the rollout engine and training backend classes, and check the plug-ins.

    Called before Ray starts (by :func:`train`, and by ``--check-only``), so that an engine, backend,
    ``--advantage-estimator``, reward function (``--rm-type`` / ``--custom-rm-path``), IS weighting function
    (``--use-tis``) or ``--dynamic-sampling-filter-path`` that is unknown or cannot be imported on this machine
    (megatron-core missing, a typo in a ``package.module:function`` path) fails at once, not after start-up.
    Each goes through its registry (:meth:`slime.utils.registry.Registry.resolve`); the functions are also
    checked for their signatures.

    Raises:
        ConfigError: naming each bad flag, its value and the import error (all of them in one message).
    """
    found, problems = [], []
    for registry, name in ((ENGINES, cfg.rollout.rollout_backend), (TRAIN_BACKENDS, cfg.train.train_backend)):
        try:  # check all, so that one run reports every problem
            found.append(registry.resolve(name))
        except ConfigError as e:
            problems.append(str(e))
    resolvers = [(resolve_advantage_estimator, cfg.grpo), (resolve_reward_function, cfg.reward)]
    if cfg.grpo.use_tis:
        resolvers.append((tis_function, cfg.grpo))
    if cfg.grpo.custom_pg_loss_reducer_function_path is not None:
        resolvers.append((pg_loss_reducer, cfg.grpo))
    if cfg.rollout.dynamic_sampling_filter_path is not None:
        resolvers.append((resolve_filter, cfg.rollout.dynamic_sampling_filter_path))
    for resolve, group in resolvers:
        try:
            resolve(group)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("; ".join(problems))
    return Components(*found)


def prepare(cfg: SlimeConfig) -> RolloutManager:
    """Everything that can be checked before Ray starts, so bad input fails in seconds.

    Resolves and checks ``--hf-checkpoint``, ``--load`` and ``--ref-load`` (logging what the run starts
    from: :func:`slime.backends.weight_sources.resolve_weights`), resolves ``--num-epoch``, loads the processor
    (pixel bounds), the training and eval data (placeholders, columns) and the reward
    function, and returns the rollout manager without engines.

    Raises:
        CheckpointError, ConfigError, DatasetError: naming the flag / file / row.
        ReplayError: ``--load-debug-rollout-data`` lacks a rollout this run replays.
    """
    start = resolve_weights(cfg.checkpoint, need_reference=cfg.grpo.needs_ref_model,
                            backend_parts=cfg.train_backend_config.checkpoint_parts())
    typo = cfg.checkpoint.load is not None and not Path(cfg.checkpoint.load).exists()
    logger.log(logging.WARNING if typo else logging.INFO, "%s", start.describe())
    _resolve_num_rollout(cfg)
    processor = load_processor(cfg.checkpoint.hf_checkpoint,
                               min_pixels=cfg.data.image_min_pixels, max_pixels=cfg.data.image_max_pixels)
    if cfg.run_mode.load_debug_rollout_data:
        check_saved_rollouts(cfg.run_mode.load_debug_rollout_data,
                             range(start.next_rollout_id, cfg.rollout.num_rollout))
    fingerprint = None
    if cfg.run_mode.save_debug_rollout_data or cfg.run_mode.load_debug_rollout_data:
        fingerprint = model_fingerprint(processor.tokenizer, read_config(cfg.checkpoint.hf_checkpoint) or {})
    return RolloutManager(
        rollout=cfg.rollout, data=cfg.data, reward=cfg.reward, grpo=cfg.grpo, evaluation=cfg.eval,
        processor=processor, engines=None, seed=cfg.rollout.rollout_seed,
        debug_dump=cfg.run_mode.save_debug_rollout_data, replay_from=cfg.run_mode.load_debug_rollout_data,
        fingerprint=fingerprint, replay_needs_routes=cfg.train.use_rollout_routing_replay,
    )


def check_cpu_run(cfg: SlimeConfig) -> None:
    """Refuse, before anything starts, the flags that a run without GPUs cannot take
    (:meth:`slime.backends.config.BackendConfig.cpu_problem`).

    Raises:
        ConfigError: naming the flags and the fix.
    """
    problem = cfg.train_backend_config.cpu_problem()
    if problem:
        raise ConfigError(problem)


def setup(
    cfg: SlimeConfig, components: Components, rollout_manager: RolloutManager, cleanup: contextlib.ExitStack
) -> Run:
    """Reserve resources, start engines and trainers, resume from ``--load``, sync weights.

    Needs a running Ray (:func:`slime.ray.placement.init_ray`) and the output of :func:`prepare`.
    Everything started is stopped when ``cleanup`` closes, also if this function raises.
    """
    use_gpu = cluster_num_gpus() > 0
    if use_gpu:
        check_resources(cfg.cluster, cluster_num_gpus())  # the one check parse time could not run
        check_environment()
    else:
        check_cpu_run(cfg)
        check_cpu_memory(cfg.cluster, weights_bytes(cfg.checkpoint.hf_checkpoint))
    placement = create_placement_groups(cfg.cluster, use_gpu=use_gpu)
    cleanup.callback(placement.remove)
    engines, trainers = start_workers(cfg, placement, components, cleanup)
    rollout_manager.engines = engines
    # as the engines capture routes (EngineSpec.return_routed_experts), unless only a skipped old-log-prob pass (the
    # router agreement) would read them: R3 replays them
    rollout_manager.return_routed_experts = (cfg.engine_spec(components.engine_cls.parity_check).return_routed_experts
                                             and (cfg.train.use_rollout_routing_replay
                                                  or not cfg.train.skip_actor_forward_only))
    if trainers is None or engines is None:  # --debug-rollout-only / --load-debug-rollout-data
        logger.info("%s: %s", "--debug-rollout-only" if trainers is None else "--load-debug-rollout-data",
                    "no trainer starts" if trainers is None else "no rollout engine starts, no weight sync, no eval")
        return setup_debug(cfg, rollout_manager, engines, trainers)
    memory = ColocatedMemory(trainers, engines, enabled=placement.colocate and placement.use_gpu,
                             measure=placement.use_gpu)
    with memory.startup_phase():
        start = trainers.init()
    if start > 0:
        rollout_manager.load_state_dict(torch.load(ckpt.rollout_state_path(cfg.checkpoint.load, start - 1)))
    if start > 0:  # records after the checkpoint go (a restart at 0 had claim_run_dirs drop them, if allowed)
        dropped = truncate_metrics(make_run_dir(cfg) / METRICS_FILE, keep=lambda r: _logged_before(r, start))
        logger.info("resumed from %s at rollout %d (%d metrics records after the checkpoint dropped)",
                    cfg.checkpoint.load, start, dropped)
    with memory.sync_phase():
        trainers.update_weights(engines)  # engines start from --hf-checkpoint; after --load they must catch up
    engines.set_resync(functools.partial(resync_engines, memory, trainers, engines))
    parity = EngineParityCheck(cfg.parity, rollout_manager.dataset, cfg.rollout.rollout_temperature,
                               enabled=components.engine_cls.parity_check, start=start, seed=cfg.rollout.rollout_seed)
    return Run(engines, trainers, rollout_manager, memory, start, cfg.rollout.num_rollout, parity)


def setup_debug(cfg: SlimeConfig, rollout_manager: RolloutManager,
                engines: RolloutEngineGroup | None, trainers: TrainerGroup | None) -> Run:
    """:func:`setup` with one side missing: trainers alone (a replay resumes from ``--load`` as usual; the prompt
    cursor is not needed) or engines alone (from ``--hf-checkpoint``, rollout 0 on; no checkpoint is written)."""
    start = 0
    if trainers is not None:
        start = trainers.init()
        if start > 0:
            truncate_metrics(make_run_dir(cfg) / METRICS_FILE, keep=lambda r: _logged_before(r, start))
    memory = ColocatedMemory(trainers, engines, enabled=False)
    return Run(engines, trainers, rollout_manager, memory, start, cfg.rollout.num_rollout, EngineParityCheck.off())


def resync_engines(memory: ColocatedMemory, trainers: TrainerGroup, engines: RolloutEngineGroup) -> None:
    """Push the trainers' current weights into every engine in the middle of a rollout (the engine group's
    re-sync hook, :meth:`RolloutEngineGroup.set_resync`: restarted engines, and no other engine left to serve).

    The weights are the ones the rollout started with (the trainers have not trained since the last sync).
    Colocated memory order (:meth:`ColocatedMemory.resync_phase`): engines release everything, trainers
    onload their weights only (the optimizer state stays off the GPU); engines resume their weights, the
    push, trainers offload, engines resume the KV cache and CUDA graphs; engines resident and trainers
    offloaded again, as the rest of the rollout expects (the next training step onloads everything).
    ``trainers.update_weights`` ends with ``engines.weights_updated()`` (the transport's ``end_sync``).
    """
    with memory.resync_phase():
        trainers.update_weights(engines)


def start_workers(
    cfg: SlimeConfig, placement: Placement, components: Components, cleanup: contextlib.ExitStack
) -> tuple[RolloutEngineGroup, TrainerGroup]:
    """Start the rollout engines and the trainer ranks (not yet initialised) on ``placement``.

    The engines load their models while the trainer ranks start; returns once every engine is
    healthy (``--rollout-engine-start-timeout``).  Both groups are shut down when ``cleanup``
    closes, registered as soon as each one exists.

    Raises:
        EngineStartError: an engine failed to start or was not healthy in time (named in the message).
    """
    engine_cls = components.engine_cls
    engines = trainers = None
    if not cfg.run_mode.debug_train_only:
        engine_factory = functools.partial(engine_cls.from_spec, cfg.engine_spec(engine_cls.parity_check))
        engines = RolloutEngineGroup(placement, engine_factory, engine_cls.max_concurrent_calls)
        cleanup.callback(engines.shutdown)
    if not cfg.run_mode.debug_rollout_only:
        backend_cls = components.backend_cls
        backend_factory = functools.partial(backend_cls, spec=cfg.trainer_spec(),
                                            config=cfg.backend_config(backend_cls))
        transport = make_transport(
            engine_cls.weight_transports, cfg.weight_sync, use_gpu=placement.use_gpu, colocate=placement.colocate,
            num_experts=checkpoint_num_experts(cfg.checkpoint.hf_checkpoint),
        )
        trainers = TrainerGroup(placement, backend_factory, cfg.train.global_batch_size, transport)
        cleanup.callback(trainers.shutdown)
    if engines is not None:
        engines.wait_until_healthy(cfg.rollout.rollout_engine_start_timeout)
    return engines, trainers


def save(cfg: SlimeConfig, rollout_id: int, trainers: TrainerGroup, rollout_manager: RolloutManager) -> None:
    """Write every part of the checkpoint of ``rollout_id``, without marking it as the latest.

    :func:`loop` marks it (:func:`slime.checkpoints.layout.mark_latest`) once the step's metrics
    records are on disk, so that a resume, which starts after the marked step, never misses them.
    """
    root = cfg.checkpoint.save
    trainers.save(rollout_id, ckpt.iteration_dir(root, rollout_id))
    torch.save({"rollout_id": rollout_id, **rollout_manager.state_dict()}, ckpt.rollout_state_path(root, rollout_id))
    logger.info("saved checkpoint of rollout %d to %s", rollout_id, ckpt.iteration_dir(root, rollout_id))


def _logged_before(record: dict, start: int) -> bool:
    """Whether a metrics record belongs to the history before resuming at rollout ``start`` (>= 1,
    after a checkpoint): rollout records of steps < start, eval records of steps <= start (see :func:`loop`)."""
    is_eval = any(key.startswith("eval/") for key in record)
    return record["step"] <= start if is_eval else record["step"] < start


def _resolve_num_rollout(cfg: SlimeConfig) -> None:
    """Turn ``--num-epoch`` into ``--num-rollout`` (``epochs * rows // rollout_batch_size``, rows
    counted before skips, at least 1), so every worker, e.g. the LR schedule, sees the run's length."""
    if cfg.rollout.num_rollout is None:
        rows = load_table(cfg.data.prompt_data, default_split="train").table.num_rows
        cfg.rollout.num_rollout = max(1, cfg.rollout.num_epoch * rows // cfg.rollout.rollout_batch_size)
        logger.info("--num-epoch %s over %d rows: %d rollout steps", cfg.rollout.num_epoch, rows, cfg.rollout.num_rollout)


def _due(rollout_id: int, interval: int | None, num_rollout: int) -> bool:
    """Whether a periodic action (eval, save) runs after ``rollout_id``: every ``interval``
    steps (never when ``interval`` is None) and always after the last step."""
    if rollout_id + 1 == num_rollout:
        return True
    return interval is not None and (rollout_id + 1) % interval == 0


def make_run_dir(cfg: SlimeConfig) -> Path:
    """The run directory (``--output-dir``, default ``outputs/<run-name or slime-<timestamp>>``, written back to
    ``cfg``), created if missing."""
    if cfg.logging.output_dir is None:
        cfg.logging.output_dir = str(Path("outputs") / (cfg.logging.run_name or time.strftime("slime-%Y%m%d-%H%M%S")))
    run_dir = Path(cfg.logging.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
