"""Hugging Face Qwen3.5-MoE tensor names <-> native Megatron parameters: one :class:`ParamRule` per parameter.

A rule says which Hugging Face tensors a parameter comes from, which slice of them a rank reads
(TP / ETP / EP; PP by the layers the rank holds) and how a TP (or ETP) group's shards go back to them;
experts are read in either on-disk layout (per-expert or fused 3-D) and exported per expert.  The reading
and writing is :mod:`slime.models.qwen3_5.weights`; the table of names and layouts is
``docs/design/qwen35_native.md``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable

import torch

from slime.checkpoints.mtp import MTP_PREFIX
from slime.models.qwen3_5.config import Qwen35Arch

LM = "model.language_model"
VISUAL = "model.visual."


class WeightMappingError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape, or a model parameter has no rule."""


class TensorReader(abc.ABC):
    """Read Hugging Face tensors by name, optionally only a slice of dims 0 and 1 (implementations:
    :mod:`slime.models.qwen3_5.weights`)."""

    @abc.abstractmethod
    def names(self) -> set[str]: ...

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool:
        return name in self.names()


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This rank's coordinates in the groups that shard parameters (megatron-core's groups)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def from_parallel_state(cls) -> "Ranks":
        """The current process's ranks from ``megatron.core.parallel_state``."""
        from megatron.core import parallel_state as ps

        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
        )


def _block(index: int, size: int) -> slice:
    return slice(index * size, (index + 1) * size)


@dataclasses.dataclass
class ParamRule:
    """How one native parameter maps to Hugging Face tensors.

    Attributes:
        name: the native parameter name (``model.named_parameters()``).
        hf_names: the Hugging Face tensors it is read from (the fused expert tensors for a fused checkpoint).
        local_shape: the parameter's shape on this rank.
        group: ``"tp"``, ``"etp"`` (the group whose shards make the full tensors) or ``"none"`` (replicated).
        load: reads this rank's local tensor from a :class:`TensorReader`.
        export: the group's shards, ordered by rank -> ``{hf_name: tensor}`` (experts always per expert).
    """

    name: str
    hf_names: tuple[str, ...]
    local_shape: tuple[int, ...]
    group: str
    load: Callable[[TensorReader], torch.Tensor]
    export: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]]


def _replicated(name: str, hf: str, shape) -> ParamRule:
    return ParamRule(name, (hf,), tuple(shape), "none", lambda r: r.read(hf), lambda shards: {hf: shards[0]})


def _split_rows(name: str, hf: str, full_rows: int, rest: tuple[int, ...], tp: Ranks) -> ParamRule:
    """Rows split evenly over TP."""
    n = full_rows // tp.tp_size
    return ParamRule(name, (hf,), (n, *rest), "tp", lambda r: r.read(hf, rows=_block(tp.tp_rank, n)),
                     lambda shards: {hf: torch.cat(shards, 0)})


def _split_cols(name: str, hf: str, rows: int, full_cols: int, tp: Ranks) -> ParamRule:
    """Columns (dim 1) split evenly over TP (row-parallel linears)."""
    n = full_cols // tp.tp_size
    return ParamRule(name, (hf,), (rows, n), "tp", lambda r: r.read(hf, cols=_block(tp.tp_rank, n)),
                     lambda shards: {hf: torch.cat(shards, 1)})


def _vocab_rule(name: str, hf: str, arch: Qwen35Arch, padded: int, ranks: Ranks) -> ParamRule:
    per = padded // ranks.tp_size
    start = ranks.tp_rank * per

    def load(r: TensorReader):
        stop = min(start + per, arch.vocab_size)
        part = r.read(hf, rows=slice(start, stop)) if stop > start else None
        if part is not None and stop - start == per:
            return part
        out = torch.zeros(per, arch.hidden_size, dtype=part.dtype if part is not None else torch.float32)
        if part is not None:
            out[: stop - start] = part
        return out

    return ParamRule(name, (hf,), (per, arch.hidden_size), "tp", load,
                     lambda shards: {hf: torch.cat(shards, 0)[: arch.vocab_size]})


def _multi_rows(name: str, parts: list[tuple[str, int, int]], rest: tuple[int, ...], ranks: Ranks) -> ParamRule:
    """Rank r's row blocks of several HF row ranges ``(hf_name, row_offset, rows)``, each split evenly over TP."""
    tp = ranks.tp_size
    local = [rows // tp for _, _, rows in parts]

    def load(r: TensorReader):
        return torch.cat([r.read(hf, rows=slice(off + ranks.tp_rank * n, off + (ranks.tp_rank + 1) * n))
                          for (hf, off, _), n in zip(parts, local)], 0)

    def export(shards):
        pieces = [torch.split(s, local, 0) for s in shards]
        out: dict[str, list[torch.Tensor]] = {}
        for j, (hf, _, _) in enumerate(parts):
            out.setdefault(hf, []).append(torch.cat([p[j] for p in pieces], 0))
        return {hf: torch.cat(ts, 0) for hf, ts in out.items()}

    hf_names = tuple(dict.fromkeys(hf for hf, _, _ in parts))
    return ParamRule(name, hf_names, (sum(local), *rest), "tp", load, export)


def _gdn_rules(prefix: str, hf: str, arch: Qwen35Arch, ranks: Ranks) -> list[ParamRule]:
    K, V = arch.linear_num_key_heads, arch.linear_num_value_heads
    dk, dv, h = arch.linear_key_head_dim, arch.linear_value_head_dim, arch.hidden_size
    qkv = f"{hf}in_proj_qkv.weight"
    in_proj = _multi_rows(f"{prefix}in_proj.weight", [
        (qkv, 0, K * dk), (qkv, K * dk, K * dk), (qkv, 2 * K * dk, V * dv),
        (f"{hf}in_proj_z.weight", 0, V * dv), (f"{hf}in_proj_b.weight", 0, V), (f"{hf}in_proj_a.weight", 0, V),
    ], (h,), ranks)
    conv = f"{hf}conv1d.weight"
    conv_rule = _multi_rows(f"{prefix}conv1d.weight", [(conv, 0, K * dk), (conv, K * dk, K * dk),
                                                       (conv, 2 * K * dk, V * dv)],
                            (1, arch.linear_conv_kernel_dim), ranks)
    return [
        in_proj, conv_rule,
        _split_rows(f"{prefix}A_log", f"{hf}A_log", V, (), ranks),
        _split_rows(f"{prefix}dt_bias", f"{hf}dt_bias", V, (), ranks),
        _replicated(f"{prefix}norm.weight", f"{hf}norm.weight", (dv,)),
        _split_cols(f"{prefix}out_proj.weight", f"{hf}out_proj.weight", h, V * dv, ranks),
    ]


def _attention_rules(prefix: str, hf: str, arch: Qwen35Arch, ranks: Ranks) -> list[ParamRule]:
    H, Hkv, d, h = arch.num_attention_heads, arch.num_query_groups, arch.head_dim, arch.hidden_size
    tp, r = ranks.tp_size, ranks.tp_rank
    hr, kvr = H // tp, Hkv // tp
    q_proj, k_proj, v_proj = (f"{hf}{p}_proj.weight" for p in "qkv")

    def load(reader: TensorReader):
        qg = reader.read(q_proj, rows=_block(r, hr * 2 * d)).reshape(hr, 2, d, h)
        return torch.cat([qg[:, 0].reshape(hr * d, h), qg[:, 1].reshape(hr * d, h),
                          reader.read(k_proj, rows=_block(r, kvr * d)), reader.read(v_proj, rows=_block(r, kvr * d))])

    def export(shards):
        parts = [torch.split(s, [hr * d, hr * d, kvr * d, kvr * d], 0) for s in shards]
        q = torch.cat([p[0] for p in parts]).reshape(H, d, h)
        g = torch.cat([p[1] for p in parts]).reshape(H, d, h)
        return {q_proj: torch.stack([q, g], 1).reshape(2 * H * d, h),
                k_proj: torch.cat([p[2] for p in parts]), v_proj: torch.cat([p[3] for p in parts])}

    return [
        ParamRule(f"{prefix}linear_qkv.weight", (q_proj, k_proj, v_proj), ((2 * hr + 2 * kvr) * d, h), "tp",
                  load, export),
        _replicated(f"{prefix}q_layernorm.weight", f"{hf}q_norm.weight", (d,)),
        _replicated(f"{prefix}k_layernorm.weight", f"{hf}k_norm.weight", (d,)),
        _split_cols(f"{prefix}linear_proj.weight", f"{hf}o_proj.weight", h, H * d, ranks),
    ]


def _expert_rules(prefix: str, hf: str, arch: Qwen35Arch, ranks: Ranks, fused: bool) -> list[ParamRule]:
    E, inter, h = arch.num_experts, arch.moe_ffn_hidden_size, arch.hidden_size
    el = E // ranks.ep_size
    ir = inter // ranks.etp_size
    experts = range(ranks.ep_rank * el, (ranks.ep_rank + 1) * el)
    rows = _block(ranks.etp_rank, ir)
    per_expert = [(f"{hf}experts.{e}.gate_proj.weight", f"{hf}experts.{e}.up_proj.weight",
                   f"{hf}experts.{e}.down_proj.weight") for e in experts]
    gate_up, down = f"{hf}experts.gate_up_proj", f"{hf}experts.down_proj"

    def load1(reader: TensorReader):
        if fused:
            gu = reader.read(gate_up, rows=slice(experts.start, experts.stop))  # [el, 2I, h]
            return torch.cat([gu[:, : inter][:, rows], gu[:, inter:][:, rows]], 1)
        return torch.stack([torch.cat([reader.read(g, rows=rows), reader.read(u, rows=rows)]) for g, u, _ in per_expert])

    def load2(reader: TensorReader):
        if fused:
            return reader.read(down, rows=slice(experts.start, experts.stop))[:, :, rows]
        return torch.stack([reader.read(dn, cols=rows) for _, _, dn in per_expert])

    def export1(shards):
        out = {}
        for j, (g, u, _) in enumerate(per_expert):
            out[g] = torch.cat([s[j, :ir] for s in shards])
            out[u] = torch.cat([s[j, ir:] for s in shards])
        return out

    def export2(shards):
        return {dn: torch.cat([s[j] for s in shards], 1) for j, (_, _, dn) in enumerate(per_expert)}

    names1 = (gate_up,) if fused else tuple(n for g, u, _ in per_expert for n in (g, u))
    names2 = (down,) if fused else tuple(dn for _, _, dn in per_expert)
    return [ParamRule(f"{prefix}weight1", names1, (el, 2 * ir, h), "etp", load1, export1),
            ParamRule(f"{prefix}weight2", names2, (el, h, ir), "etp", load2, export2)]


def _moe_rules(prefix: str, hf: str, arch: Qwen35Arch, ranks: Ranks, fused: bool) -> list[ParamRule]:
    h, inter_s = arch.hidden_size, arch.shared_expert_intermediate_size
    se = f"{hf}shared_expert."
    return [
        _replicated(f"{prefix}router.weight", f"{hf}gate.weight", (arch.num_experts, h)),
        *_expert_rules(f"{prefix}experts.", hf, arch, ranks, fused),
        _multi_rows(f"{prefix}shared_experts.linear_fc1.weight",
                    [(f"{se}gate_proj.weight", 0, inter_s), (f"{se}up_proj.weight", 0, inter_s)], (h,), ranks),
        _split_cols(f"{prefix}shared_experts.linear_fc2.weight", f"{se}down_proj.weight", h, inter_s, ranks),
        _replicated(f"{prefix}shared_experts.gate_weight", f"{hf}shared_expert_gate.weight", (1, h)),
    ]


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """Which parts of the model a rank holds: its layers (local index -> 0-based global layer) and stages."""

    layers: tuple[tuple[int, int], ...]
    pre_process: bool = True
    post_process: bool = True
    vision: bool = True

    @classmethod
    def for_stage(cls, arch: Qwen35Arch, pp_rank: int = 0, pp_size: int = 1, vision: bool = True) -> "ModelLayout":
        """Layers split evenly over ``pp_size`` stages (megatron-core's default without first/last overrides)."""
        per = arch.num_layers // pp_size
        if per * pp_size != arch.num_layers:
            raise WeightMappingError(f"{arch.num_layers} layers do not split evenly over {pp_size} pipeline stages")
        return cls(layers=tuple((i, pp_rank * per + i) for i in range(per)), pre_process=pp_rank == 0,
                   post_process=pp_rank == pp_size - 1, vision=vision and pp_rank == 0 and arch.vision_config is not None)

    @classmethod
    def of_model(cls, model) -> "ModelLayout":
        """The layout of a built ``Qwen35Model``."""
        layers = tuple((i, layer.layer_number - 1) for i, layer in enumerate(model.decoder.layers))
        return cls(layers=layers, pre_process=model.pre_process, post_process=model.post_process,
                   vision=getattr(model, "visual", None) is not None)


def param_rules(
    arch: Qwen35Arch,
    layout: ModelLayout,
    ranks: Ranks = Ranks(),
    *,
    fused_experts: bool = False,
    vision_names: Iterable[tuple[str, tuple[int, ...]]] = (),
) -> dict[str, ParamRule]:
    """Every native parameter of a rank, by name, with its :class:`ParamRule`, in model order.

    ``fused_experts``: the checkpoint stores experts fused (``experts.gate_up_proj``); ``vision_names``:
    ``(name, shape)`` of the vision tower's parameters (without ``model.visual.``) when ``layout.vision``.
    """
    rules: list[ParamRule] = []
    padded = arch.padded_vocab_size(ranks.tp_size)
    if layout.pre_process:
        rules.append(_vocab_rule("embedding.weight", f"{LM}.embed_tokens.weight", arch, padded, ranks))
    if layout.vision:
        rules += [_replicated(f"visual.{n}", f"{VISUAL}{n}", shape) for n, shape in vision_names]
    for local, glob in layout.layers:
        p, hf = f"decoder.layers.{local}.", f"{LM}.layers.{glob}."
        rules.append(_replicated(f"{p}input_layernorm.weight", f"{hf}input_layernorm.weight", (arch.hidden_size,)))
        if arch.layer_types[glob] == "linear_attention":
            rules += _gdn_rules(f"{p}self_attention.", f"{hf}linear_attn.", arch, ranks)
        else:
            rules += _attention_rules(f"{p}self_attention.", f"{hf}self_attn.", arch, ranks)
        rules.append(_replicated(f"{p}pre_mlp_layernorm.weight", f"{hf}post_attention_layernorm.weight",
                                 (arch.hidden_size,)))
        rules += _moe_rules(f"{p}mlp.", f"{hf}mlp.", arch, ranks, fused_experts)
    if layout.post_process:
        rules.append(_replicated("decoder.final_layernorm.weight", f"{LM}.norm.weight", (arch.hidden_size,)))
        rules.append(_vocab_rule("output_layer.weight", "lm_head.weight", arch, padded, ranks))
    return {rule.name: rule for rule in rules}


def checkpoint_has_fused_experts(reader: TensorReader) -> bool:
    """Whether the checkpoint stores the model's experts (an MTP layer's do not count) as fused 3-D tensors
    (``...mlp.experts.gate_up_proj``)."""
    return any(n.endswith("mlp.experts.gate_up_proj") and not n.startswith(MTP_PREFIX) for n in reader.names())
