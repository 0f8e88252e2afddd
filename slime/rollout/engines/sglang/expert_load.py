"""Fused-expert weight loading inside SGLang's server processes: a layer's routed experts in a few copies.

The weight sync sends each MoE layer's experts fused (:mod:`slime.weight_sync.fused_experts`): ``gate_up_proj`` ``[E,
2I, H]`` (expert ``e``'s gate rows, then its up rows) and ``down_proj`` ``[E, H, I]``.  :func:`wrap_load_weights` copies
each into its ``FusedMoE`` layer's ``w13_weight`` ``[E_local, 2 I_tp, H]`` or ``w2_weight`` ``[E_local, H, I_tp]`` with
SGLang's own slices (``FusedMoE._load_w13`` / ``_load_w2``) where the layer has the plain layout
(:func:`plain_layout_problem`), checking every copy against SGLang's loader; everything else goes to SGLang's
``load_weights`` unchanged, streamed in order.  Why, the slices and the check: ``docs/design/sglang_engine.md``.
"""

from __future__ import annotations

import functools
import logging
import sys
import time

import torch

logger = logging.getLogger(__name__)

FUSED_SUFFIXES = {".mlp.experts.gate_up_proj": "w13_weight", ".mlp.experts.down_proj": "w2_weight"}
"""The fused checkpoint names (suffix) and the ``FusedMoE`` parameter each one fills."""
NAME_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""), ("", ""))
"""How SGLang's Qwen3.5 classes rename a checkpoint name to their module path, tried in order."""

_MARK = "_slime_fast_expert_load"


class ExpertLoadStats:
    """What the fast path did in this process, for the plugin's report (:meth:`as_dict`): ``fast`` (tensors copied),
    ``declined`` (by reason), ``load_weights_calls`` / ``load_weights_s`` (calls of the wrapped ``load_weights``, wall
    seconds), ``disabled`` (why the fast path is off, or None)."""

    def __init__(self):
        self.fast = 0
        self.declined: dict[str, int] = {}
        self.load_weights_calls = 0
        self.load_weights_s = 0.0
        self.disabled: str | None = None

    def decline(self, reason: str) -> None:
        if reason not in self.declined:
            logger.info("slime fast expert load: SGLang's loader takes %s", reason)
        self.declined[reason] = self.declined.get(reason, 0) + 1

    def as_dict(self) -> dict:
        return {"fast": self.fast, "declined": dict(self.declined), "load_weights_calls": self.load_weights_calls,
                "load_weights_s": round(self.load_weights_s, 6), "disabled": self.disabled}


STATS = ExpertLoadStats()
"""This process's figures (one model per SGLang scheduler process)."""


def fused_target(name: str) -> tuple[str, str] | None:
    """``(the experts' module path in the checkpoint, FusedMoE parameter)`` of a fused expert name, else None:
    ``"model.language_model.layers.3.mlp.experts.down_proj"`` -> ``("model.language_model.layers.3.mlp.experts",
    "w2_weight")``."""
    for suffix, param in FUSED_SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix) + len(".mlp.experts")], param
    return None


def resolve_layer(model: torch.nn.Module, module_path: str) -> tuple[str, torch.nn.Module] | None:
    """The ``FusedMoE`` layer a checkpoint module path names in ``model`` (SGLang's renaming, :data:`NAME_PREFIXES`),
    as ``(its path in model, module)``; None when no renaming names a module with ``w13_weight``."""
    for old, new in NAME_PREFIXES:
        if not module_path.startswith(old):
            continue
        path = new + module_path[len(old):]
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if hasattr(module, "w13_weight") and hasattr(module, "w2_weight"):
            return path, module
    return None


def plain_layout_problem(layer: torch.nn.Module, param: torch.nn.Parameter) -> str | None:
    """Why ``layer`` (an SGLang ``FusedMoE``) is not in the plain layout the fast path copies into, or None:
    unquantized, gated, gate rows first, no Triton-kernel / FlashInfer TRT-LLM / padded / pre-sharded layout, no fused
    shared experts, ``param.weight_loader`` is ``FusedMoE.weight_loader``, no expert remapping
    (:func:`expert_location_problem`)."""
    method = getattr(layer, "quant_method", None)
    if type(method).__name__ != "UnquantizedFusedMoEMethod" or hasattr(layer, "scheme"):
        return f"quantized experts ({type(method).__name__})"
    config = getattr(layer, "moe_runner_config", None)
    if not getattr(config, "is_gated", False):
        return "a non-gated expert MLP"
    if getattr(method, "load_up_proj_weight_first", False):
        return "up rows first (load_up_proj_weight_first)"
    for flag in ("use_triton_kernels", "use_flashinfer_trtllm_moe", "use_padded_loading", "use_presharded_weights",
                 "_has_fused_shared"):
        if getattr(layer, flag, False):
            return f"FusedMoE.{flag}"
    if getattr(param, "_sglang_require_global_experts", False) or getattr(param, "is_transposed", False):
        return "a parameter with global experts or a transposed layout"
    loader = getattr(param, "weight_loader", None)
    if getattr(loader, "__name__", None) != "weight_loader" or getattr(loader, "__self__", None) is not layer:
        return "a parameter without FusedMoE.weight_loader"
    return expert_location_problem(layer)


def expert_location_problem(layer: torch.nn.Module) -> str | None:
    """Why SGLang's expert-location metadata makes ``layer``'s physical experts differ from the logical ones, or None:
    the fast copy is the per-expert load only when ``physical_to_logical_map[layer_id]`` is ``arange`` over as many
    physical as logical experts (no EPLB rebalancing, no redundant experts); a layer id past the map is the identity."""
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        metadata = get_global_expert_location_metadata()
    except ImportError:
        return None  # no SGLang (the CPU tests' stand-in layers): nothing remaps experts
    except Exception:  # noqa: BLE001 - SGLang's runtime context not set up: not the server's model load
        return "no SGLang runtime context"
    if metadata is None:
        return None
    if metadata.num_physical_experts != metadata.num_logical_experts:
        return "EPLB redundant experts"
    physical_to_logical = metadata.physical_to_logical_map_cpu  # [layers, num_physical], kept by SGLang's update()
    layer_id = getattr(layer, "layer_id", None)
    if layer_id is None:
        return "EPLB expert-location metadata without the layer's id"
    if layer_id >= physical_to_logical.shape[0]:
        return None
    row = physical_to_logical[layer_id]
    if not torch.equal(row.to(torch.long), torch.arange(row.numel())):
        return "EPLB expert remapping"
    return None


def local_experts(layer: torch.nn.Module, num_experts: int) -> tuple[int, int] | None:
    """``(lo, hi)``: the global experts ``lo..hi-1`` this rank holds, as ``layer``'s own mapping
    (``_map_global_expert_id_to_local_expert_id``) says, when they are one run mapped to ``0..hi-lo-1``
    and fill ``layer.w13_weight``'s expert dim; None otherwise."""
    mapping = getattr(layer, "_map_global_expert_id_to_local_expert_id", None)
    if mapping is None:
        return None
    local = [(e, mapping(e)) for e in range(num_experts)]
    held = [(e, i) for e, i in local if i >= 0]
    if not held:
        return None
    lo, hi = held[0][0], held[-1][0] + 1
    if [i for _, i in held] != list(range(hi - lo)) or [e for e, _ in held] != list(range(lo, hi)):
        return None
    if hi - lo != layer.w13_weight.shape[0]:
        return None
    return lo, hi


def _slices(layer, param_name: str, tensor: torch.Tensor, lo: int, hi: int):
    """``[(destination view, source view)]`` of one fused tensor into ``layer``'s parameter (SGLang's ``_load_w13`` /
    ``_load_w2`` slices), or None when the shapes do not fit."""
    param = getattr(layer, param_name).data
    tp_rank, tp_size = int(getattr(layer, "moe_tp_rank", 0)), int(getattr(layer, "moe_tp_size", 1))
    if param_name == "w13_weight":
        experts, two_inter, hidden = tensor.shape
        inter = two_inter // 2
        if two_inter % 2 or inter % tp_size:
            return None
        shard = inter // tp_size
        if tuple(param.shape) != (hi - lo, 2 * shard, hidden):
            return None
        rows = slice(tp_rank * shard, (tp_rank + 1) * shard)
        gate = tensor[lo:hi, :inter][:, rows]
        up = tensor[lo:hi, inter:][:, rows]
        return [(param[:, :shard], gate), (param[:, shard:], up)]
    experts, hidden, inter = tensor.shape
    if inter % tp_size:
        return None
    shard = inter // tp_size
    if tuple(param.shape) != (hi - lo, hidden, shard):
        return None
    return [(param, tensor[lo:hi, :, tp_rank * shard:(tp_rank + 1) * shard])]


def _sglang_load_one(layer, param, param_path: str, tensor: torch.Tensor, expert: int) -> None:
    """SGLang's own load of global ``expert`` from a fused tensor (what its ``load_weights`` does per expert)."""
    if param_path.endswith("w13_weight"):
        gate, up = tensor.chunk(2, dim=-2)
        param.weight_loader(param, gate[expert], param_path, "w1", expert)
        param.weight_loader(param, up[expert], param_path, "w3", expert)
    else:
        param.weight_loader(param, tensor[expert], param_path, "w2", expert)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same shape and dtype) hold the same bits: NaN equals NaN (a diverged policy's NaN must
    not read as a layout disagreement), and ``-0.0`` differs from ``0.0``."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        kind = _INT_OF_SIZE[a.element_size()]
        a, b = a.view(kind), b.view(kind)
    return torch.equal(a, b)


def fast_load(model: torch.nn.Module, name: str, tensor: torch.Tensor,
              stats: ExpertLoadStats = STATS) -> str | None:
    """Copy one fused expert tensor into its ``FusedMoE`` layer; returns the parameter's name in the model (e.g.
    ``model.layers.0.mlp.experts.w13_weight``), or None when SGLang's loader is to load it (not a fused name, not the
    plain layout, shapes that do not fit, the fast path off, or a failed check, which turns the fast path off).

    Args:
        model: the SGLang model (``self`` of ``load_weights``).
        name: the checkpoint name, e.g. ``model.language_model.layers.0.mlp.experts.gate_up_proj``.
        tensor: ``[E, 2I, H]`` (``gate_up_proj``) or ``[E, H, I]`` (``down_proj``), any device, a dtype ``copy_`` takes.
    """
    target = fused_target(name)
    if target is None or stats.disabled is not None:
        return None
    if tensor.dim() != 3:
        stats.decline("a fused expert tensor that is not 3-D")
        return None
    found = resolve_layer(model, target[0])
    if found is None:
        stats.decline("a fused expert name without a FusedMoE layer")
        return None
    path, layer = found
    param_name = target[1]
    param = getattr(layer, param_name)
    problem = plain_layout_problem(layer, param)
    if problem is not None:
        stats.decline(problem)
        return None
    routed = getattr(layer, "_num_global_routed", None)
    if routed is not None and tensor.shape[0] != routed:  # SGLang loops over the config's expert count
        stats.decline("a fused expert tensor with another number of experts than the layer")
        return None
    held = local_experts(layer, tensor.shape[0])
    slices = _slices(layer, param_name, tensor, *held) if held is not None else None
    if slices is None:
        stats.decline("fused expert shapes that do not match the layer")
        return None
    for destination, source in slices:
        destination.copy_(source)
    lo, hi = held
    param_path = f"{path}.{param_name}"
    for expert in sorted({lo, hi - 1}):  # SGLang's loader on the first and the last local expert must agree
        copied = param.data[expert - lo].clone()
        param.data[expert - lo].fill_(float("nan"))  # so that a loader writing nothing here cannot pass
        _sglang_load_one(layer, param, param_path, tensor, expert)
        if not same_bits(param.data[expert - lo], copied):
            stats.disabled = (f"{name}: expert {expert} differs from SGLang's own load; the fast path is off in "
                              "this process and SGLang's loader loads every fused expert tensor")
            print(f"[slime] WARNING: fast expert load {stats.disabled}", file=sys.stderr, flush=True)
            return None
    stats.fast += 1
    return param_path


def wrap_load_weights(model_cls: type, stats: ExpertLoadStats = STATS, on_load=None) -> None:
    """Wrap ``model_cls.load_weights`` so that fused expert tensors go through :func:`fast_load` and the rest to the
    original, streamed in order (idempotent); ``on_load()`` runs after each call.  Returns the original's set of loaded
    names with the fast-loaded parameters' names added."""
    original = model_cls.load_weights
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def load_weights(self, weights):
        started = time.perf_counter()
        fast_loaded: list[str] = []  # the parameters' names in the model, for SGLang's set of loaded names

        def rest():
            for name, tensor in weights:
                param_path = fast_load(self, name, tensor, stats)
                if param_path is None:
                    yield name, tensor
                else:
                    fast_loaded.append(param_path)

        try:
            loaded = original(self, rest())
        finally:
            stats.load_weights_calls += 1
            stats.load_weights_s += time.perf_counter() - started
            if on_load is not None:
                try:
                    on_load()
                except Exception as e:  # noqa: BLE001 - a report that cannot be written must not fail the load
                    logger.warning("slime fast expert load: on_load failed: %s", e)
        if isinstance(loaded, set):
            loaded.update(fast_loaded)
        return loaded

    setattr(load_weights, _MARK, True)
    model_cls.load_weights = load_weights
