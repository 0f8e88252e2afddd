"""MoE routing replay (R3, R2) and the routes it replays, in one place (``docs/design/routing_replay.md``).

An engine running an MoE model reports, per position it ran a forward for, the ``top_k`` experts each MoE layer
chose there: for a prompt of ``P`` tokens and a response of ``R``, ``[P + R - 1, layers, top_k]`` (the last response
token is never fed back), kept on a sample as uint8 (:data:`ROUTE_DTYPE`, models of up to :data:`MAX_EXPERTS`).
Here, in the order a run meets them:

- parse time: which runs may replay (:func:`check_routing_replay`, :func:`resolve_parity_replay`) and whether the
  engines capture routes (:func:`rollout_routes_wanted`);
- a sample's routes: their shape (:class:`RouteShape`), checks and compaction, their layout on a micro-batch's token
  axis (:func:`token_routes`, with :data:`OWN_ROUTE` where the model keeps its own choice) and back;
- the training step's one routing pass (:class:`StepRoutes`): R3's engine routes on every forward, the old-log-prob
  pass recording the routers' choices (R2's record, the monitor's router agreement), then R2's recorded routes on
  every training forward;
- the forward itself: every MoE layer takes the given experts with gate weights recomputed from its own router logits
  (:func:`forced_gate_weights`, so the router still learns); the Hugging Face model's routers through hooks
  (:func:`force_hf_routes`, :func:`capture_hf_routes`; a padded micro-batch's: :func:`hf_padded_routes`), the native
  model's in :class:`slime.models.qwen3_5.router.Qwen35Router` (packed micro-batches': :func:`packed_routes`).

torch is imported where a function needs it, so that the flag parser can import this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from slime.checkpoints.hf import read_config, text_fields
from slime.utils.config import ConfigError

if TYPE_CHECKING:
    from torch import Tensor, nn

    from slime.backends.config import BackendConfig, CheckpointConfig, TrainConfig
    from slime.data.sample import Sample
    from slime.rollout.config import ParityConfig

logger = logging.getLogger(__name__)

ROUTE_DTYPE = np.uint8
"""How samples and engine outputs store expert ids."""
MAX_EXPERTS = 256
"""The most experts per layer :data:`ROUTE_DTYPE` can name."""
OWN_ROUTE = -1
"""In :func:`token_routes`: the model routes this position itself."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RouteError(ValueError):
    """Routed experts of the wrong shape or range, or a model whose routes do not fit :data:`ROUTE_DTYPE`."""


@dataclasses.dataclass(frozen=True)
class RouteShape:
    """What one position's routes look like in a model: ``[num_layers, top_k]`` ids in ``[0, num_experts)``.

    Raises:
        RouteError: ``num_experts`` above :data:`MAX_EXPERTS` (``what`` names the model, e.g. its config file).
    """

    num_layers: int
    top_k: int
    num_experts: int
    what: str = "the model"

    def __post_init__(self):
        if self.num_experts > MAX_EXPERTS:
            raise RouteError(f"{self.what} has {self.num_experts} experts per layer; routed experts are stored as "
                             f"uint8, which names at most {MAX_EXPERTS}")

    @classmethod
    def from_hf_config(cls, config: dict, what: str = "config.json") -> RouteShape | None:
        """The shape of a Hugging Face ``config.json`` dict (fields ``num_hidden_layers``, ``num_experts_per_tok``,
        ``num_experts`` under ``text_config`` or at the top level, SGLang's reading); None for a dense model.

        Raises:
            RouteError: more than :data:`MAX_EXPERTS` experts.
        """
        section = text_fields(config)
        experts = section.get("num_experts")
        if not isinstance(experts, int) or experts <= 0:
            return None
        return cls(int(section["num_hidden_layers"]), int(section["num_experts_per_tok"]), experts, what)

    @classmethod
    def from_checkpoint(cls, hf_checkpoint: str) -> RouteShape | None:
        """:meth:`from_hf_config` of ``<hf_checkpoint>/config.json`` (None without one; CheckpointError if
        unreadable)."""
        config = read_config(hf_checkpoint)
        return None if config is None else cls.from_hf_config(config, f"--hf-checkpoint {hf_checkpoint}")


# ---------------------------------------------------------------------------------------- parse time


def rollout_routes_wanted(train: TrainConfig, parity: ParityConfig, hf_checkpoint: str, *,
                          parity_check: bool) -> bool:
    """Whether a run's engines capture routed experts and its training rollouts ask for them: an MoE
    ``--hf-checkpoint`` with ``--use-rollout-routing-replay`` (the trainer replays them), or with the engine parity
    check replaying them (``parity_check``: the engine kind runs it; then the engine captures every forward's routes
    anyway, and the trainer's router agreement is measured at no extra cost)."""
    replayed_by_parity = parity_check and parity.engine_parity_replay_routes and not parity.skip_engine_parity_check
    wanted = train.use_rollout_routing_replay or replayed_by_parity
    return wanted and RouteShape.from_checkpoint(hf_checkpoint) is not None


def check_routing_replay(train: TrainConfig, checkpoint: CheckpointConfig, backend: BackendConfig) -> None:
    """Refuse ``--use-routing-replay`` / ``--use-rollout-routing-replay`` where they cannot run: a dense or
    unreadable ``--hf-checkpoint``, more experts than uint8 routes name, a backend layout where replay is unproven
    (:meth:`BackendConfig.train_replay_problem`), and R2 alone with ``--use-rollout-logprobs`` (no old-log-prob pass
    to record).

    Raises:
        ConfigError: naming the flag and the reason.
    """
    if not train.use_routing_replay:
        return
    name = "--use-rollout-routing-replay" if train.use_rollout_routing_replay else "--use-routing-replay"
    config = read_config(checkpoint.hf_checkpoint)
    try:
        shape = None if config is None else RouteShape.from_hf_config(config, f"--hf-checkpoint "
                                                                               f"{checkpoint.hf_checkpoint}")
    except RouteError as e:
        raise ConfigError(f"{name}: {e}") from None
    if shape is None:
        raise ConfigError(f"{name} replays the routed experts of an MoE model, but --hf-checkpoint "
                          f"{checkpoint.hf_checkpoint} has no MoE layers (or no config.json); drop the flag")
    problem = backend.train_replay_problem()
    if problem:
        raise ConfigError(f"{name}: {problem}")
    if train.use_rollout_logprobs and not train.use_rollout_routing_replay:
        raise ConfigError("--use-routing-replay records the routes of the trainer's old-log-prob pass, which "
                          "--use-rollout-logprobs skips; use --use-rollout-routing-replay (the engine's routes) "
                          "or drop --use-rollout-logprobs")


def resolve_parity_replay(parity: ParityConfig, hf_checkpoint: str, backend: BackendConfig, *,
                          parity_check: bool) -> None:
    """Turn ``--engine-parity-replay-routes`` off, with a warning giving the reason, where it cannot run: an MoE
    ``hf_checkpoint`` with more experts than routes stored as uint8 name, or a training backend that does not replay
    routes in its layout (:meth:`BackendConfig.replay_routes_problem`).  Only where the parity check runs
    (``parity_check``: the engine kind runs it; not skipped) and the flag is on; a dense checkpoint keeps it (nothing
    to replay).  The parity check then compares unreplayed routes, as with the flag off."""
    if parity.skip_engine_parity_check or not parity.engine_parity_replay_routes or not parity_check:
        return
    problem = None
    config = read_config(hf_checkpoint)
    if config is not None:
        try:
            if RouteShape.from_hf_config(config, f"--hf-checkpoint {hf_checkpoint}") is None:
                return  # a dense model: nothing to replay
        except RouteError as e:
            problem = str(e)
    problem = problem or backend.replay_routes_problem()
    if problem:
        parity.engine_parity_replay_routes = False
        logger.warning(
            "--engine-parity-replay-routes is off for this run: %s. The engine parity check compares the engine's "
            "log-probs without replaying its routes, which at real width (random routers) cannot tell the "
            "multimodal-RoPE bug from routing flips (docs/design/parity_gate.md); --no-engine-parity-replay-routes "
            "silences this", problem)


# ---------------------------------------------------------------------------------------- a sample's routes


def compact_routes(ids: np.ndarray, shape: RouteShape, where: str) -> np.ndarray:
    """``ids`` (any integer array ``[N, num_layers, top_k]``) as :data:`ROUTE_DTYPE`.

    Raises:
        RouteError: another layer count or top-k, or an id outside ``[0, num_experts)`` (``where`` names the
            request or sample).
    """
    ids = np.asarray(ids)
    if ids.ndim != 3 or ids.shape[1:] != (shape.num_layers, shape.top_k):
        raise RouteError(f"{where}: routed experts of shape {list(ids.shape)}, expected [positions, "
                         f"{shape.num_layers} layers, top-{shape.top_k}]")
    if ids.size and (ids.min() < 0 or ids.max() >= shape.num_experts):
        raise RouteError(f"{where}: routed expert ids span {int(ids.min())}..{int(ids.max())}, outside 0.."
                         f"{shape.num_experts - 1}")
    return ids.astype(ROUTE_DTYPE)


def check_routes(routes: np.ndarray, prompt_len: int, response_len: int, shape: RouteShape, where: str) -> None:
    """Refuse routes that are not ``[prompt_len + response_len - 1, layers, top_k]`` :data:`ROUTE_DTYPE` ids of
    ``shape``.

    Raises:
        RouteError: naming ``where``, the shape found and the one expected.
    """
    expected = (prompt_len + response_len - 1, shape.num_layers, shape.top_k)
    if not isinstance(routes, np.ndarray) or routes.dtype != ROUTE_DTYPE or routes.shape != expected:
        found = (f"{routes.dtype} {list(routes.shape)}" if isinstance(routes, np.ndarray)
                 else type(routes).__name__)
        raise RouteError(f"{where}: routed experts are {found}, expected uint8 {list(expected)} (prompt "
                         f"{prompt_len} + response {response_len} - 1 positions, {shape.num_layers} layers, "
                         f"top-{shape.top_k})")
    if routes.size and int(routes.max()) >= shape.num_experts:
        raise RouteError(f"{where}: routed expert id {int(routes.max())} >= the model's {shape.num_experts} experts")


def route_problem(samples: Sequence[Sample], shape: RouteShape) -> str | None:
    """Why the engine routes of the first sample that R3 cannot replay do not fit: none (``rollout_routed_experts``
    None), or not ``[P + R - 1, layers, top_k]`` ids of ``shape`` (:func:`check_routes`); None when every one fits."""
    for sample in samples:
        where = f"sample {sample.index} (group {sample.group_index})"
        if sample.rollout_routed_experts is None:
            return (f"{where} has no rollout_routed_experts to replay; the engine returns them only when asked "
                    "(return_routed_experts) and started to capture them")
        try:
            check_routes(sample.rollout_routed_experts, len(sample.prompt_token_ids), sample.response_length, shape,
                         where)
        except RouteError as e:
            return str(e)
    return None


def token_routes(routes: Sequence[np.ndarray], starts: Sequence[int], total: int, shape: RouteShape) -> np.ndarray:
    """One micro-batch's routes on its token axis: int16 ``[total, num_layers, top_k]``, sample ``i``'s
    ``[n_i, num_layers, top_k]`` at rows ``starts[i] .. starts[i] + n_i`` (padded rows ``b * T``, or packed
    offsets), :data:`OWN_ROUTE` everywhere else (each response's last token, padding)."""
    out = np.full((total, shape.num_layers, shape.top_k), OWN_ROUTE, dtype=np.int16)
    for routes_i, start in zip(routes, starts, strict=True):
        out[start: start + len(routes_i)] = routes_i
    return out


def sample_routes(token_axis: np.ndarray, starts: Sequence[int], lengths: Sequence[int],
                  shape: RouteShape) -> list[np.ndarray]:
    """The inverse of :func:`token_routes`: from a micro-batch's ``[total, num_layers, top_k]`` ids on its token axis
    (a router's own choices), sample ``i``'s rows ``starts[i] .. starts[i] + lengths[i]`` as :data:`ROUTE_DTYPE`.

    Raises:
        RouteError: ids of another shape or outside ``[0, num_experts)``.
    """
    return [compact_routes(token_axis[start: start + n], shape, f"the trainer's routes of sample {i}")
            for i, (start, n) in enumerate(zip(starts, lengths, strict=True))]


# ---------------------------------------------------------------------------------------- the training step's pass


@dataclasses.dataclass
class StepRoutes:
    """Routing replay for one training step (module docstring), decided before its first forward.

    Attributes:
        shape: the policy's routes where it can replay them (an MoE policy in a layout that replays), else None.
        engine: R3: every forward of the step takes the engine's routes (``MicroBatch.routes`` set when packing).
        record: R2 alone: the training forwards take the routes the old-log-prob pass took.
        capture: the old-log-prob pass records the routers' choices (``MicroBatch.trainer_routes``): R2's record,
            and the monitor's router agreement where samples carry engine routes.
        problem: R3: why the engine routes of a sample cannot be replayed (:func:`route_problem`), else None;
            :func:`slime.backends.samples.check_train_samples` raises it on every rank, before any forward.
    """

    shape: RouteShape | None
    engine: bool
    record: bool
    capture: bool
    problem: str | None = None

    @classmethod
    def for_step(cls, train: TrainConfig, route_shape: Callable[[], RouteShape],
                 samples: Sequence[Sample]) -> StepRoutes:
        """From the flags, the policy's ``route_shape()`` (NotImplementedError, saying why, where it cannot replay)
        and the step's samples (with R3 their engine routes checked: :attr:`problem`).

        Raises:
            NotImplementedError: ``--use-routing-replay`` (or R3) with a policy that cannot replay.
        """
        r3, r2 = train.use_rollout_routing_replay, train.use_routing_replay
        if r2:
            shape = route_shape()
        else:
            try:
                shape = route_shape()
            except NotImplementedError:
                shape = None
        capture = shape is not None and (r2 or any(s.rollout_routed_experts is not None for s in samples))
        problem = route_problem(samples, shape) if r3 and shape is not None else None
        return cls(shape, r3, r2 and not r3, capture, problem)

    def after_old_pass(self, batches: Sequence) -> dict[str, float]:
        """After the old-log-prob pass over ``batches`` (``MicroBatch`` es): the monitor's router agreement sums
        (:func:`route_agreement_sums`; ``{}`` where the policy cannot replay), then R2's record as every batch's
        routes from now on."""
        sums = {} if self.shape is None else self._agreement_sums(batches if self.capture else [])
        for batch in batches if self.record else ():
            batch.routes = batch.trainer_routes
        return sums

    def _agreement_sums(self, batches: Sequence) -> dict[str, float]:
        """:func:`route_agreement_sums` of the captured routes against the engine's, for the samples that carry
        well-formed engine routes (the others are counted in ``routes/skipped`` and logged)."""
        pairs, skipped = [], []
        for batch in batches:
            for sample, mine in zip(batch.samples, batch.trainer_routes or [], strict=False):
                if sample.rollout_routed_experts is None:
                    continue
                try:
                    check_routes(sample.rollout_routed_experts, len(sample.prompt_token_ids), sample.response_length,
                                 self.shape, f"sample {sample.index}")
                except RouteError as e:
                    skipped.append(str(e))
                    continue
                pairs.append((sample, mine))
        if skipped:
            logger.warning("%d sample(s) with malformed engine routes are left out of train/router_agreement "
                           "(first: %s)", len(skipped), skipped[0])
        return {**route_agreement_sums(pairs), "routes/skipped": float(len(skipped))}


def route_agreement_sums(pairs: Sequence[tuple[Sample, np.ndarray]]) -> dict[str, float]:
    """This rank's sums for ``train/router_agreement``: per kind (``image`` / ``text`` prompts) ``routes/<kind>/agree``
    and ``routes/<kind>/pairs``, always all present.  ``pairs``: (sample, the trainer's routes), both uint8
    ``[P + R - 1, layers, top_k]`` (the engine's on ``sample.rollout_routed_experts``, checked); a (position, layer)
    pair agrees when the two top-k *sets* are equal (the order of the k ids is not compared).

    Raises:
        ValueError: the two arrays of a sample differ in shape.
    """
    sums = {f"routes/{kind}/{what}": 0.0 for kind in ("image", "text") for what in ("agree", "pairs")}
    for sample, trainer in pairs:
        engine = sample.rollout_routed_experts
        if engine.shape != trainer.shape:
            raise ValueError(f"sample {sample.index}: engine routes {list(engine.shape)}, trainer routes "
                             f"{list(trainer.shape)}")
        same = (np.sort(engine, axis=-1) == np.sort(trainer, axis=-1)).all(axis=-1)
        kind = "image" if sample.has_images else "text"
        sums[f"routes/{kind}/agree"] += float(same.sum())
        sums[f"routes/{kind}/pairs"] += float(same.size)
    return sums


# ---------------------------------------------------------------------------------------- the forward


def forced_gate_weights(router_logits: Tensor, experts: Tensor) -> Tensor:
    """float32 ``[N, k]`` gate weights of ``experts`` (int64 ``[N, k]``) from ``router_logits`` (``[N, E]``): the
    softmax over all experts taken at ``experts``, renormalised to sum 1 (transformers' ``Qwen3_5MoeTopKRouter``;
    in exact arithmetic megatron-core's softmax over the top-k logits); differentiable in ``router_logits``."""
    import torch

    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32).gather(-1, experts)
    return probs / probs.sum(dim=-1, keepdim=True)


def choose_routes(forced: Tensor | None, own: Tensor) -> Tensor:
    """``forced`` (int ``[N, k]``, rows of :data:`OWN_ROUTE` where the model chooses) with those rows taken from
    ``own`` (int64 ``[N, k]``, the model's choice); ``own`` when ``forced`` is None.

    Raises:
        ValueError: ``forced`` has another number of rows or columns than ``own``.
    """
    import torch

    if forced is None:
        return own
    if forced.shape != own.shape:
        raise ValueError(f"replayed routes of shape {list(forced.shape)} for a router that routes "
                         f"{list(own.shape)} (tokens, top-k)")
    forced = forced.to(device=own.device, dtype=torch.int64)
    return torch.where(forced[:, :1] >= 0, forced, own)


def hf_moe_routers(model: nn.Module) -> list[nn.Module]:
    """The transformers MoE routers of ``model`` (modules whose class name ends in ``TopKRouter``), in layer order.

    Raises:
        ValueError: a router outside a ``layers.<i>.`` module, or two in one layer.
    """
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("TopKRouter"):
            continue
        match = _LAYER.search(name)
        if match is None or int(match.group(1)) in found:
            raise ValueError(f"cannot tell the layer of the MoE router {name}")
        found[int(match.group(1))] = module
    return [found[i] for i in sorted(found)]


@contextlib.contextmanager
def force_hf_routes(model: nn.Module, routes: Tensor) -> Iterator[None]:
    """Inside the block, layer ``l``'s router of ``model`` routes token ``n`` to ``routes[n, l]`` (its own choice
    where that row is :data:`OWN_ROUTE`), with :func:`forced_gate_weights` in the router's dtype.

    Args:
        model: a transformers MoE model (every forward inside must have ``N`` tokens, batch and time flattened
            row-major, as the routers see them).
        routes: int ``[N, layers, top_k]`` (:func:`token_routes`).

    Raises:
        ValueError: ``routes`` names another number of layers than the model's routers, or (in a forward)
            another number of tokens or top-k.
    """
    routers = hf_moe_routers(model)
    if routes.shape[1] != len(routers):
        raise ValueError(f"routes for {routes.shape[1]} layers, the model has {len(routers)} MoE routers")

    def hook(layer: int):
        def replace(module, args, out):
            logits, weights, own = out
            index = choose_routes(routes[:, layer], own)
            return logits, forced_gate_weights(logits, index).to(weights.dtype), index
        return replace

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def hf_padded_routes(model: nn.Module, batch, width: int, shape: RouteShape | None, *, replay: bool,
                     capture: bool, device=None) -> Iterator[None]:
    """Routing replay around forwards of a Hugging Face MoE ``model`` over one padded micro-batch (sample ``b`` on row
    ``b``, starting at token ``b * width``; ``batch``: a :class:`slime.backends.step.MicroBatch`): with ``replay`` its
    routers take ``batch.routes`` (:func:`force_hf_routes`); with ``capture`` ``batch.trainer_routes`` gets each
    sample's own routes of the block's last forward, uint8 ``[P + R - 1, layers, top_k]``.  ``shape``: the policy's
    (needed with either); ``device``: the model's inputs' (where the replayed routes go).

    Raises:
        ValueError / RouteError: routes that do not fit the model (:func:`force_hf_routes`, :func:`sample_routes`).
    """
    import torch

    starts = [b * width for b in range(len(batch.samples))]
    with contextlib.ExitStack() as stack:
        if replay:
            routes = token_routes(batch.routes, starts, len(starts) * width, shape)
            stack.enter_context(force_hf_routes(model, torch.from_numpy(routes).to(device)))
        calls = stack.enter_context(capture_hf_routes(model)) if capture else None
        yield
    if calls is not None:
        token_axis = torch.stack([layer[-1] for layer in calls], dim=1).numpy()
        lengths = [len(s.prompt_token_ids) + s.response_length - 1 for s in batch.samples]
        batch.trainer_routes = sample_routes(token_axis, starts, lengths, shape)


@contextlib.contextmanager
def packed_routes(batches: Sequence, shape: RouteShape | None, *, replay: bool,
                  capture: contextlib.AbstractContextManager | None = None) -> Iterator[list]:
    """Routing replay around forwards of the native model (:mod:`slime.models.qwen3_5`, the Megatron backend's) over
    packed micro-batches (``batches``: :class:`slime.backends.step.MicroBatch` es whose ``packed`` is the Megatron
    backend's ``PackedBatch``, sample ``i`` from token ``inputs.cu_seqlens[i]``).  Yields the packed forms to run: with
    ``replay`` each batch's ``routes`` (where set) on its token axis (:func:`with_packed_routes`); with ``capture``
    (the model's ``captured_routes(model)``: layer number -> one ``[N_f, top_k]`` tensor per forward) every batch's
    ``trainer_routes`` gets its samples' own routes of the block's forwards (one per batch, in order), uint8
    ``[P + R - 1, layers, top_k]``.  ``shape``: the policy's (needed with either).

    Raises:
        ValueError / RouteError: routes that do not fit the model (:func:`token_routes`, :func:`sample_routes`).
    """
    import torch

    packed = [b.packed if not replay or b.routes is None else with_packed_routes(b.packed, b.routes, shape)
              for b in batches]
    with capture or contextlib.nullcontext() as calls:
        yield packed
    if calls is not None:
        for i, batch in enumerate(batches):
            token_axis = torch.stack([calls[layer][i] for layer in range(1, shape.num_layers + 1)], dim=1).numpy()
            bounds = batch.packed.inputs.cu_seqlens.tolist()  # the model's token axis (not the loss's)
            starts = bounds[: len(batch.packed.response_lengths)]
            lengths = [end - start - 1 for start, end in zip(starts, bounds[1:])]
            batch.trainer_routes = sample_routes(token_axis, starts, lengths, shape)


def with_packed_routes(batch, routes: Sequence[np.ndarray], shape: RouteShape):
    """The Megatron backend's packed ``batch`` with its samples' routed experts (``routes``, uint8 ``[P + R - 1,
    layers, top_k]`` per sample) on its token axis as ``inputs.routed_experts`` (:func:`token_routes`: from each
    sample's first token; the model's own choice at its last token and on the padding)."""
    import torch

    starts = batch.inputs.cu_seqlens[: len(routes)].tolist()
    token_axis = token_routes(routes, starts, batch.num_tokens, shape)
    inputs = dataclasses.replace(batch.inputs,
                                 routed_experts=torch.from_numpy(token_axis).to(batch.inputs.input_ids.device))
    return dataclasses.replace(batch, inputs=inputs)


@contextlib.contextmanager
def capture_hf_routes(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Record the experts every MoE router of ``model`` chooses inside the block.

    Yields:
        ``calls``: ``calls[l]`` is the list of layer ``l``'s choices, one int64 ``[N_f, top_k]`` CPU tensor per
        forward ``f`` (its tokens flattened row-major), filled as the forwards run.
    """
    import torch

    routers = hf_moe_routers(model)
    calls: list[list[Tensor]] = [[] for _ in routers]

    def hook(layer: int):
        def record(module, args, out):
            calls[layer].append(out[2].detach().to("cpu", torch.int64))
        return record

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(routers)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
