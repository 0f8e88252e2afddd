"""Hugging Face Qwen3.5-MoE checkpoint <-> the native Megatron model: names, shapes, layouts, per-rank slices.

One :class:`ParamRule` per parameter of the native model says which Hugging Face tensors it comes
from, which slice of them this rank reads (TP / ETP / EP; PP by which layers the rank holds), and
how the shards of a TP (or ETP) group go back to the Hugging Face tensors.  Loading reads only the
rank's slices (``safetensors`` ``get_slice``); exporting gathers a parameter's shards within its
TP/ETP group and yields Hugging Face ``(name, tensor)`` pairs.

Hugging Face names and on-disk layouts (transformers 5.17, ``Qwen3_5MoeForConditionalGeneration``;
``L = model.language_model``, ``l`` the 0-based layer):

=============================================================  ===========================================
HF tensor                                                      native parameter (TP-local layout)
=============================================================  ===========================================
``L.embed_tokens.weight [V, h]``                               ``embedding.weight [Vp/tp, h]`` (rows of the rank; padding rows 0)
``lm_head.weight [V, h]``                                      ``output_layer.weight [Vp/tp, h]``
``L.norm.weight``                                              ``decoder.final_layernorm.weight``
``L.layers.l.input_layernorm.weight``                          ``decoder.layers.i.input_layernorm.weight``
``L.layers.l.post_attention_layernorm.weight``                 ``decoder.layers.i.pre_mlp_layernorm.weight``
``...linear_attn.in_proj_qkv [2K dk + V dv, h]``,              ``...self_attention.in_proj.weight``
``in_proj_z [V dv, h]``, ``in_proj_b [V, h]``, ``in_proj_a``   ``[q_r | k_r | v_r | z_r | b_r | a_r]`` (heads of rank r)
``...linear_attn.conv1d.weight [2K dk + V dv, 1, k]``          ``...self_attention.conv1d.weight [q_r | k_r | v_r]``
``...linear_attn.A_log [V]``, ``dt_bias [V]``                  ``...self_attention.A_log``, ``dt_bias`` (value heads of r)
``...linear_attn.norm.weight [dv]``                            ``...self_attention.norm.weight`` (replicated)
``...linear_attn.out_proj.weight [h, V dv]``                   ``...self_attention.out_proj.weight`` (columns of r)
``...self_attn.q_proj.weight [2 H d, h]`` per head [q; gate]   ``...self_attention.linear_qkv.weight``
``k_proj``, ``v_proj [H_kv d, h]``                             ``[q_r | gate_r | k_r | v_r]`` (de-interleaved)
``...self_attn.q_norm``, ``k_norm [d]``                        ``...self_attention.q_layernorm``, ``k_layernorm``
``...self_attn.o_proj.weight [h, H d]``                        ``...self_attention.linear_proj.weight`` (columns of r)
``...mlp.gate.weight [E, h]``                                  ``...mlp.router.weight`` (replicated)
``...mlp.experts.e.{gate,up}_proj.weight [I, h]``,             ``...mlp.experts.weight1 [E/ep, 2 I/etp, h]`` ([gate | up] rows of etp rank)
``down_proj.weight [h, I]`` (or fused ``experts.gate_up_proj   ``...mlp.experts.weight2 [E/ep, h, I/etp]``
[E, 2I, h]`` / ``experts.down_proj [E, h, I]``)
``...mlp.shared_expert.{gate,up}_proj.weight [Is, h]``         ``...mlp.shared_experts.linear_fc1.weight [gate_r | up_r]``
``...mlp.shared_expert.down_proj.weight [h, Is]``              ``...mlp.shared_experts.linear_fc2.weight`` (columns of r)
``...mlp.shared_expert_gate.weight [1, h]``                    ``...mlp.shared_experts.gate_weight [1, h]``
``model.visual.*``                                             ``visual.*`` (unchanged, replicated)
=============================================================  ===========================================

Experts are read in either on-disk layout (per-expert tensors, as Qwen3.5 checkpoints and
transformers' ``save_pretrained`` store them, or fused 3-D tensors) and exported per expert.
``mtp.*`` (multi-token prediction) tensors of released checkpoints are not part of the model and
are skipped (counted in :class:`LoadReport`).
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch

from slime.models.qwen3_5.config import Qwen35Arch

LM = "model.language_model"
VISUAL = "model.visual."


class WeightMappingError(ValueError):
    """A checkpoint tensor is missing or has the wrong shape, or a model parameter has no rule."""


# ----------------------------------------------------------------------------------------------
# Reading Hugging Face tensors (whole or a slice)
# ----------------------------------------------------------------------------------------------


class TensorReader(abc.ABC):
    """Read Hugging Face tensors by name, optionally only a slice of dims 0 and 1 (implementations:
    :class:`StateDictReader`, :class:`SafetensorsReader`)."""

    @abc.abstractmethod
    def names(self) -> set[str]: ...

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool:
        return name in self.names()


class StateDictReader(TensorReader):
    """A ``{name: tensor}`` mapping (e.g. a transformers model's on-disk state) as a reader."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name, rows=None, cols=None):
        t = self.tensors[name]
        if rows is not None:
            t = t[rows]
        if cols is not None:
            t = t[:, cols]
        return t


class SafetensorsReader(TensorReader):
    """A Hugging Face checkpoint folder (``model.safetensors`` or a sharded index) read lazily.

    Only the requested slice of a tensor is read from disk (``safe_open(...).get_slice``).

    Raises:
        WeightMappingError: no safetensors file in the folder.
    """

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.folder / "model.safetensors").is_file():
            with safe_open(self.folder / "model.safetensors", framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise WeightMappingError(f"{self.folder}: no model.safetensors or model.safetensors.index.json")
        self.weight_map: dict[str, str] = weight_map
        self._open: dict[str, object] = {}
        self._safe_open = safe_open

    def _file(self, name: str):
        fname = self.weight_map[name]
        if fname not in self._open:
            self._open[fname] = self._safe_open(self.folder / fname, framework="pt")
        return self._open[fname]

    def names(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, name):
        return tuple(self._file(name).get_slice(name).get_shape())

    def read(self, name, rows=None, cols=None):
        sl = self._file(name).get_slice(name)
        if rows is None and cols is None:
            return sl[:]
        rows = rows if rows is not None else slice(None)
        return sl[rows, cols] if cols is not None else sl[rows]


# ----------------------------------------------------------------------------------------------
# Ranks and rules
# ----------------------------------------------------------------------------------------------


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
        hf_names: the Hugging Face tensors it is read from (the fused expert tensors for a
            fused checkpoint; export always writes per-expert tensors).
        local_shape: the parameter's shape on this rank.
        group: the group whose shards make the full tensors: ``"tp"``, ``"etp"`` or ``"none"``
            (replicated: any rank's copy is the full tensor).
        load: reads this rank's local tensor from a :class:`TensorReader`.
        export: from the group's shards (ordered by rank in the group) to ``{hf_name: tensor}``.
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
    """A local tensor made of rank-r row blocks of several HF row ranges.

    ``parts``: ``(hf_name, row_offset, rows)`` = an HF tensor's rows ``[row_offset, row_offset + rows)``
    split evenly over TP; the local tensor concatenates each part's block of rank r.  On export,
    parts of the same HF tensor are concatenated in the order given.
    """
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
    """Every native parameter of a rank, by name, with its :class:`ParamRule`.

    Args:
        arch: the checkpoint's arch.
        layout: the rank's layers and stages.
        ranks: the rank's TP / EP / ETP coordinates.
        fused_experts: the checkpoint stores experts fused (``experts.gate_up_proj``).
        vision_names: ``(name, shape)`` of the vision tower's parameters (without ``model.visual.``),
            when ``layout.vision``.

    Returns:
        ``{native name: rule}`` in model order (embedding, vision, layers, final norm, LM head).
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
    """Whether the checkpoint stores experts as fused 3-D tensors (``...mlp.experts.gate_up_proj``)."""
    return any(n.endswith("mlp.experts.gate_up_proj") for n in reader.names())


# ----------------------------------------------------------------------------------------------
# Load / export
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LoadReport:
    """What a load read: parameters filled, checkpoint tensors skipped by prefix (e.g. ``mtp.``)."""

    loaded: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)


SKIPPED_PREFIXES = ("mtp.",)
"""Checkpoint tensors that are not part of the model (Qwen3.5's multi-token-prediction head)."""


def read_rank_state(reader: TensorReader, rules: Mapping[str, ParamRule]) -> dict[str, torch.Tensor]:
    """``{native name: local tensor}`` read through ``rules`` (only the rank's slices are read).

    Raises:
        WeightMappingError: a Hugging Face tensor is missing (naming it and the parameter), or a
            read tensor's shape differs from the rule's local shape.
    """
    names = reader.names()
    out = {}
    for name, rule in rules.items():
        missing = [hf for hf in rule.hf_names if hf not in names]
        if missing:
            raise WeightMappingError(f"{name}: checkpoint has no {missing[0]}" +
                                     (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        tensor = rule.load(reader)
        if tuple(tensor.shape) != rule.local_shape:
            raise WeightMappingError(f"{name}: read {tuple(tensor.shape)} from {rule.hf_names[0]}, "
                                     f"the model holds {rule.local_shape}")
        out[name] = tensor
    return out


def vision_param_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    visual = getattr(model, "visual", None)
    return [] if visual is None else [(n, tuple(p.shape)) for n, p in visual.named_parameters()]


def model_rules(model, ranks: Ranks | None = None, *, fused_experts: bool = False) -> dict[str, ParamRule]:
    """The rules of a built ``Qwen35Model`` on this rank (ranks from megatron-core by default)."""
    ranks = ranks if ranks is not None else Ranks.from_parallel_state()
    return param_rules(model.qwen_config.arch, ModelLayout.of_model(model), ranks, fused_experts=fused_experts,
                       vision_names=vision_param_shapes(model))


@torch.no_grad()
def load_hf_checkpoint(model, hf_checkpoint: str | Path | TensorReader, ranks: Ranks | None = None) -> LoadReport:
    """Fill a built ``Qwen35Model`` from a Hugging Face checkpoint, reading only this rank's slices.

    A model built on the meta device is materialised on the parameters' target device first
    (``to_empty``; CUDA when available).  Tensors are cast to each parameter's dtype (``A_log``
    stays fp32).

    Args:
        model: the native model (one pipeline stage of it).
        hf_checkpoint: checkpoint folder (or a :class:`TensorReader`).
        ranks: TP / EP / ETP coordinates (default: megatron-core's current ones).

    Returns:
        A :class:`LoadReport`.

    Raises:
        WeightMappingError: a model parameter without a rule, a missing checkpoint tensor, a
            shape mismatch (each naming the parameter and the tensor).
    """
    reader = hf_checkpoint if isinstance(hf_checkpoint, TensorReader) else SafetensorsReader(hf_checkpoint)
    rules = model_rules(model, ranks, fused_experts=checkpoint_has_fused_experts(reader))
    params = dict(model.named_parameters())
    unmapped = [n for n in params if n not in rules]
    if unmapped:
        raise WeightMappingError(f"model parameters without a checkpoint rule: {unmapped[:5]}")
    if any(p.is_meta for p in params.values()):
        materialize(model, torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
        params = dict(model.named_parameters())
    state = read_rank_state(reader, rules)
    for name, tensor in state.items():
        params[name].copy_(tensor.to(params[name].dtype))
    used = {hf for rule in rules.values() for hf in rule.hf_names}
    report = LoadReport(loaded=len(state))
    for name in reader.names() - used:
        prefix = next((p for p in SKIPPED_PREFIXES if name.startswith(p)), "other")
        report.skipped[prefix] = report.skipped.get(prefix, 0) + 1
    return report


def materialize(model, device) -> None:
    """Give a meta-device ``Qwen35Model`` real (uninitialised) storage on ``device``, before a load.

    The language-model parts get ``to_empty`` and their non-persistent buffers recomputed
    (``reset_buffers``); the transformers vision tower is rebuilt on ``device`` instead, so that its
    own non-persistent buffers (rotary frequencies) are computed by transformers.
    """
    from slime.models.qwen3_5.vision import build_vision_tower

    # to_empty replaces a meta parameter by a new Parameter object: keep the attributes megatron-core
    # reads from it (tensor_model_parallel, partition_dim, sequence_parallel, allreduce, keep_fp32).
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}
    for name, child in model.named_children():
        if name == "visual":
            continue
        if any(t.is_meta for t in (*child.parameters(), *child.buffers())):
            child.to_empty(device=device)
    for buffer_name, buffer in list(model.named_buffers(recurse=False)):
        if buffer.is_meta:
            setattr(model, buffer_name, torch.empty_like(buffer, device=device))
    visual = getattr(model, "visual", None)
    if visual is not None and any(p.is_meta for p in visual.parameters()):
        arch, dtype = model.qwen_config.arch, next(visual.parameters()).dtype
        model.visual = build_vision_tower(arch.vision_config, dtype=dtype, device=device)
    for name, p in model.named_parameters():
        if not name.startswith("visual."):
            p.__dict__.update(attributes.get(name, {}))
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


@dataclasses.dataclass(frozen=True)
class ExportGroups:
    """Who gathers and who yields each parameter's Hugging Face tensors (see :func:`export_hf_weights`).

    Attributes:
        ranks: this rank's TP / EP / ETP coordinates.
        tp_group, etp_group: megatron-core's tensor- and expert-tensor-parallel groups.
        dense_source: data-parallel rank 0 (with CP): the replica whose dense and vision tensors are sent.
        expert_source: expert-data-parallel rank 0: the replica whose experts are sent.
    """

    ranks: Ranks
    tp_group: object
    etp_group: object
    dense_source: bool
    expert_source: bool

    @classmethod
    def current(cls, ranks: Ranks | None = None) -> "ExportGroups":
        """From megatron-core's parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            ranks=ranks if ranks is not None else Ranks.from_parallel_state(),
            tp_group=ps.get_tensor_model_parallel_group(), etp_group=ps.get_expert_tensor_parallel_group(),
            dense_source=ps.get_data_parallel_rank(with_context_parallel=True) == 0,
            expert_source=ps.get_expert_data_parallel_rank() == 0,
        )

    def gathers(self, rule: ParamRule) -> bool:
        """This rank takes part in the rule's gather (its replica is the one sent)."""
        return self.expert_source if rule.group == "etp" else self.dense_source

    def yields(self, rule: ParamRule) -> bool:
        """This rank is the single source of the rule's Hugging Face tensors."""
        group_rank = self.ranks.etp_rank if rule.group == "etp" else self.ranks.tp_rank
        return self.gathers(rule) and (rule.group == "none" or group_rank == 0)


def export_rule(rule: ParamRule, tensor: torch.Tensor, groups: ExportGroups) -> dict[str, torch.Tensor] | None:
    """One parameter (or a tensor of its local shape, e.g. an optimizer moment) as Hugging Face tensors.

    Collective within the rule's TP / ETP group when :meth:`ExportGroups.gathers` (every rank of that
    group calls it for the same rules in the same order); returns the tensors on the source rank
    (:meth:`ExportGroups.yields`), ``None`` elsewhere.
    """
    if not groups.gathers(rule):
        return None
    if rule.group == "tp":
        shards = _gather(tensor, groups.tp_group)
    elif rule.group == "etp":
        shards = _gather(tensor, groups.etp_group)
    else:
        shards = [tensor]
    return rule.export(shards) if groups.yields(rule) else None


def export_hf_weights(model, *, ranks: Ranks | None = None, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream this rank's Hugging Face ``(name, tensor)`` pairs, the rank being their single source.

    Every parameter's shards are gathered within its TP (or, for experts, ETP) group; the pair is
    then yielded by group rank 0 only, and only on data-parallel rank 0 (dense and vision
    parameters) or expert-data-parallel rank 0 (experts).  Pipeline stages yield their own layers,
    EP ranks their own experts.  So across the whole job every Hugging Face tensor is yielded
    exactly once.  Every rank of a TP / ETP group must exhaust the iterator (the gathers are
    collective), also the ranks that yield nothing.

    Args:
        model: the native model (this rank's stage).
        ranks: default megatron-core's current ranks.
        dtype: cast yielded tensors (default: the parameters' own dtypes).

    Yields:
        ``(hf_name, tensor)``, tensors on the parameters' device.
    """
    groups = ExportGroups.current(ranks)
    rules = model_rules(model, groups.ranks)
    params = dict(model.named_parameters())
    for name, rule in rules.items():
        out = export_rule(rule, params[name].detach(), groups)
        for hf_name, value in (out or {}).items():
            yield hf_name, value if dtype is None else value.to(dtype)
