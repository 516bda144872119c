"""The attention function registered with ``AttentionInterface``: a model's attention as a spec.

transformers calls it as it calls ``sdpa_attention_forward``:
``attention(module, query, key, value, attention_mask, dropout=, scaling=, sliding_window=,
softcap=, s_aux=, ...)`` with ``query`` ``[B, H, T, D]`` and ``key``/``value`` ``[B, KV, S, D]``
(after the cache update), and takes back ``([B, T, H, E] output, None)``. ``attention_mask``
is what :func:`attncomp.hf.masks.attncomp_mask` returned (:class:`MaskFacts`), or None.

The spec's arguments are filled by name (docs/api.md section 10): its first three are query,
key and value; ``shift``, ``q_doc``, ``k_doc`` come from the mask's facts; ``sinks`` is the
layer's ``s_aux``; ``seed`` a new random integer each call where the layer drops out attention
(training with an attention dropout rate, the constant ``dropout``); any other name is
``inputs[name](module)`` or the attention module's attribute of that name. Its keyword constants
``scale``, ``window``, ``softcap``, ``causal`` and ``dropout``, where it declares them, are the
layer's. Each (spec, backend, constants) is
compiled once, on first use, and its torch op is shared by every layer that uses it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

import attncomp as ac
from attncomp.hf.masks import MaskFacts
from attncomp.hf.specs import (
    DEFAULT_SPECS,
    MASK_SPECS,
    hf_attention_position_bias,
    hf_attention_position_bias_rows,
    with_dropout,
)
from attncomp.torch.traced_ops import TracedOps, trace_constant

#: the arguments filled from the mask and the layer, by name
FACTS = ("shift", "q_doc", "k_doc", "q_blk", "k_blk", "mask", "position_bias", "sinks", "seed")
#: the constants filled from the layer (and ``floor`` from a float mask's type), by name
LAYER_CONSTANTS = ("scale", "window", "softcap", "causal", "floor", "dropout")

#: the torch op of each "spec key/backend/constants", by the name :func:`op_key` gives
OPS = TracedOps()
#: spec key (its name and id) -> the spec, for :func:`op_key` (which takes only constants)
SPECS: dict[str, ac.Spec] = {}


def spec_key(spec: ac.Spec) -> str:
    """A name for ``spec`` that no other spec object has (specs made by a function share names)."""
    key = f"{spec.name}#{id(spec)}"
    SPECS[key] = spec  # held, so the id is never reused
    return key


def op_key(spec: str, backend: str, constants: tuple[tuple[str, Any], ...]) -> str:
    """Compile the spec of key ``spec`` with ``constants`` once; give the name of its torch op in ``OPS``.

    Under ``torch.compile`` it runs at trace time, not in the graph
    (``assume_constant_result``), so compiling a spec never breaks the graph.
    """
    return OPS.name(
        f"{spec}/{backend}/{constants}",
        lambda: ac.compile(SPECS[spec], backend=backend, **dict(constants)).to_torch(),
    )


#: ``op_key`` as torch.compile sees it: a constant of the trace
constant_op_key = torch.compiler.assume_constant_result(op_key)


class AttncompAttention:
    """One registered attention: a spec (or the default specs) on a backend.

    ``spec=None`` picks the default spec for each call: with segments when the batch is padded
    or packed, with sinks when the layer has them (:mod:`attncomp.hf.specs`).
    """

    def __init__(
        self,
        name: str,
        spec: ac.Spec | None = None,
        backend: str = "cpu",
        inputs: dict[str, Callable[[Any], Any]] | None = None,
    ):
        self.name = name
        self.spec = spec
        self.backend = backend
        self.inputs = dict(inputs or {})
        defaults = [*DEFAULT_SPECS.values(), *MASK_SPECS.values()]
        defaults += [hf_attention_position_bias, hf_attention_position_bias_rows]
        # a model in training mode asks for their dropout variants: made and named here, not during a call,
        # which torch.compile traces (the trace defers writes to module state, so a spec registered
        # there would be missing when op_key, run at trace time, looks it up)
        defaults += [with_dropout(s) for s in defaults]
        self._keys = {s.name: spec_key(s) for s in (defaults if spec is None else [spec])}
        if spec is not None and len(spec.arg_names) < 3:
            raise TypeError(f"attncomp.hf: @{spec.name} must take query, key and value as its first three arguments")

    def __call__(
        self,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        s_aux: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        facts = self._facts(module, query, key, attention_mask, sliding_window, kwargs.get("is_causal"))
        # the layer's numbers, which the spec compiles in: Python numbers even where the trace holds them
        # as symbols (torch.compile with dynamic=True: the module's attributes)
        scaling, softcap, dropout = (trace_constant(x) for x in (scaling, softcap, dropout))
        default = trace_constant(query.shape[-1]) ** -0.5
        scale = default if scaling is None else float(scaling)
        if self.spec is None and scale == default:  # the default specs read D ** -0.5 from the sizes
            scale = None
        window = trace_constant(facts.window or 0)
        layer = {"scale": scale, "window": window, "softcap": float(softcap or 0.0), "causal": facts.causal}
        layer["dropout"] = float(dropout or 0.0)
        mask = None if facts.dense is None else dense_mask(facts.dense, query, key)
        bias = kwargs.get("position_bias")
        if bias is not None:
            bias = position_bias(bias, query, key)
            if mask is not None:  # a mask given as data too: one float mask a head, as sdpa combines them
                shown = mask if mask.dim() == 4 else mask[:, None]
                mask = torch.where(shown, bias, -torch.inf) if shown.dtype == torch.bool else bias + shown
                bias = None
        if mask is not None and mask.dtype != torch.bool:
            layer["floor"] = torch.finfo(mask.dtype).min / 2
        spec = self.spec or default_spec(facts, mask, bias, s_aux)
        if layer["dropout"] and self.spec is None:
            spec = with_dropout(spec)
        self._check(spec, facts, layer, s_aux, query, key, bias)
        constants = tuple(
            (c, layer[c]) for c in LAYER_CONSTANTS if c in spec.constants and layer.get(c) is not None
        )  # the default specs' scale None: D ** -0.5, read from the sizes
        op = OPS[constant_op_key(self._keys[spec.name], self.backend, constants)]
        values = {"shift": facts.shift, "q_doc": facts.q_doc, "k_doc": facts.k_doc, "sinks": s_aux, "mask": mask}
        values["position_bias"] = bias
        if "seed" in spec.arg_names:  # a new draw of the dropout mask each call, from torch's CPU generator:
            # a CPU scalar, which the op passes to the device by value (no copy back, no synchronisation)
            values["seed"] = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)
        values.update(q_blk=facts.q_blk, k_blk=facts.k_blk)
        if facts.q_doc is None and "q_doc" in spec.arg_names:  # a spec that reads segments, on a batch without
            values["q_doc"] = facts.shift.new_zeros(query.shape[0], query.shape[2])
            values["k_doc"] = facts.shift.new_zeros(key.shape[0], key.shape[2])
        args = [query, key, value] + [self._argument(n, values, module) for n in spec.arg_names[3:]]
        out = op(*args)
        return out.transpose(1, 2).contiguous(), None

    def _facts(
        self, module: Any, query: Any, key: Any, mask: Any, sliding_window: int | None, is_causal: bool | None
    ) -> MaskFacts:
        """The mask's facts; with no mask (none was built), the layer's own: causal aligned bottom-right."""
        if isinstance(mask, MaskFacts):
            return mask
        shift = torch.full((query.shape[0],), key.shape[2] - query.shape[2], dtype=torch.int32, device=query.device)
        if isinstance(mask, torch.Tensor):  # a 4D mask the caller passed to the model: the whole mask
            return MaskFacts(shift, None, None, None, True, dense=mask)
        if mask is not None:
            raise NotImplementedError(f"attncomp.hf: the attention got a mask of type {type(mask).__name__}")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        return MaskFacts(shift, None, None, sliding_window, bool(causal))

    def _check(self, spec: ac.Spec, facts: MaskFacts, layer: dict, s_aux: Any, query: Any, key: Any, bias: Any) -> None:
        """Refuse what the spec cannot compute rather than compute another attention."""
        names, missing = set(spec.arg_names), []
        dense = facts.dense is not None  # the mask is the whole of it: no shift, segments, window or blocks
        if dense and "mask" not in names:
            missing.append("mask (the attention got a 4D mask, or a mask function evaluated pair by pair)")
        if facts.q_doc is not None and not {"q_doc", "k_doc"} <= names:
            missing.append("q_doc and k_doc (the batch is padded or packed)")
        if facts.q_blk is not None and not {"q_blk", "k_blk"} <= names:
            missing.append("q_blk and k_blk (the mask has bidirectional blocks, such as an image's tokens)")
        if bias is not None and "position_bias" not in names:
            missing.append("position_bias (the model adds a bias per head to the scores)")
        if layer["dropout"] and not ("seed" in names and "dropout" in spec.constants):
            missing.append(
                f"seed and the constant dropout (the layer drops out attention with rate {layer['dropout']}: "
                "ac.dropout(ac.softmax(s), dropout, seed), or put the model in eval mode)"
            )
        if s_aux is not None and "sinks" not in names:
            missing.append("sinks (the layer has attention sinks)")
        if layer["window"] and "window" not in spec.constants:
            missing.append(f"the constant window (the layer's sliding window is {layer['window']})")
        if layer["softcap"] and "softcap" not in spec.constants:
            missing.append(f"the constant softcap (the layer soft-caps its scores at {layer['softcap']})")
        if not dense and "shift" not in names and query.shape[2] != key.shape[2]:
            missing.append("shift (the keys include earlier tokens from a cache)")
        if missing:
            raise TypeError(f"attncomp.hf: @{spec.name} takes no {'; no '.join(missing)}")

    def _argument(self, name: str, values: dict[str, Any], module: Any) -> Any:
        if name in FACTS and values.get(name) is not None:
            return values[name]
        if name in self.inputs:
            return self.inputs[name](module)
        if hasattr(module, name):
            return getattr(module, name)
        raise TypeError(
            f"attncomp.hf: @{self.spec.name if self.spec else name} takes {name!r}, which is not a fact of the mask "
            f"({', '.join(FACTS)}), an entry of inputs=, or an attribute of {type(module).__name__}"
        )

    def __repr__(self) -> str:
        spec = self.spec.name if self.spec else "the default specs"
        return f"<attncomp.hf attention {self.name!r}: {spec}, {self.backend}>"


def dense_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A mask given as data, as a spec reads it: ``[B, T, S]`` where one serves every head, else
    ``[B, H, T, S]``; its keys cut to the layer's, as SDPA's caller does; a float mask in the
    query's type, a boolean one as it is."""
    (batch, heads, length), keys = query.shape[:3], key.shape[2]
    shape = tuple(mask.shape)
    if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2] != length:
        raise ValueError(
            f"attncomp.hf: attention_mask: a 4D mask must be [{batch} or 1, 1 or {heads}, {length}, keys] "
            f"for these queries, got {list(shape)}"
        )
    if shape[3] < keys:
        raise ValueError(f"attncomp.hf: attention_mask: the 4D mask covers {shape[3]} keys; the layer has {keys}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"attncomp.hf: attention_mask: a 4D mask must be boolean or float, got {mask.dtype}")
    if mask.dtype != torch.bool:
        mask = boolean_form(mask.to(query.dtype))
    mask = mask[..., :keys].expand(batch, -1, -1, -1)
    return mask[:, 0] if shape[1] == 1 else mask


def default_spec(facts: MaskFacts, mask: Any, bias: Any, s_aux: Any) -> ac.Spec:
    """The default spec for a call: by what its mask holds, a position bias, sinks (the specs of
    :mod:`attncomp.hf.specs`); two that no default spec takes together are refused by name."""
    blocks = facts.q_blk is not None
    parts = {
        "a position_bias": bias is not None,
        "a mask given as data (a 4D mask, or a custom mask function)": mask is not None,
        "bidirectional blocks": blocks,
        "attention sinks": s_aux is not None,
    }
    present = [name for name, there in parts.items() if there]
    if len(present) > 1:
        raise NotImplementedError(
            f"attncomp.hf: {' and '.join(present)} in one layer: no default spec takes them together; register a "
            "spec that does (attncomp.hf.register(name, spec=...))"
        )
    if bias is not None:
        return hf_attention_position_bias if bias.dim() == 3 else hf_attention_position_bias_rows
    if mask is not None:
        return MASK_SPECS[(mask.dtype == torch.bool, mask.dim() == 4)]
    return DEFAULT_SPECS[(facts.q_doc is not None or blocks, s_aux is not None, blocks)]


def position_bias(bias: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A model's ``position_bias`` (``[B or 1, H, T, S]``, T5's) as a spec reads it, in the query's type:
    ``[H, T, S]`` where one serves the whole batch (never copied per row), else ``[B, H, T, S]``."""
    (batch, heads, length), keys = query.shape[:3], key.shape[2]
    shape = tuple(bias.shape)
    if len(shape) != 4 or shape[0] not in (1, batch) or shape[1:] != (heads, length, keys):
        raise ValueError(
            f"attncomp.hf: position_bias must be [{batch} or 1, {heads}, {length}, {keys}] for these queries and "
            f"keys, got {list(shape)}"
        )
    bias = bias.to(query.dtype)
    return bias[0] if shape[0] == 1 else bias


#: (a weak reference to the float mask last seen, its version, its boolean form or None where it has
#: none): a forward hands every layer the same mask, so it is read once a forward, not once a layer;
#: the entry goes with the mask, so no mask outlives its forward here
_LAST: list[Any] = [None, -1, None]


def _forget(held: weakref.ref) -> None:
    if _LAST[0] is held:
        _LAST[:] = [None, -1, None]


def boolean_form(mask: torch.Tensor) -> torch.Tensor:
    """A float mask whose every value is 0 or at most half the type's lowest (transformers' own masks:
    0 and the lowest value) as the boolean mask it is: the same attention, whose tiles that it shows
    whole read nothing. Else (biases, a mask that learns, under ``torch.compile``, which cannot branch
    on data) the float mask itself."""
    if mask.requires_grad or torch.compiler.is_compiling():
        return mask
    held, version, form = _LAST
    if held is not None and held() is mask and version == mask._version:
        return mask if form is None else form
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    form = ~hidden if bool((hidden | (mask == 0)).all()) else None
    held = weakref.ref(mask)
    _LAST[:] = [held, mask._version, form]
    weakref.finalize(mask, _forget, held)
    return mask if form is None else form
