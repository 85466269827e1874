"""``TPPlan``, the plan registry, lookup by model type, and plans written as plain mappings (job files).

A plan maps module-name patterns (``fnmatch`` style, ``*`` matches any text
including dots) to styles:

``"column"``        ``ColumnParallelLinear`` (output features split; with ``sections`` a fused
                    projection whose sections are split one by one)
``"column_qkv"``    a fused q/k/v projection of 3 equal sections (``column`` with ``sections=3``)
``"row"``           ``RowParallelLinear`` (input features split, output all-reduced)
``"vocab"``         ``VocabParallelEmbedding``
``"lm_head"``       column over the vocabulary; gathers the logits unless the plan
                    (or ``parallelize``) asks for the vocab-parallel loss
``"experts"``       a transformers mixture-of-experts block of fused expert weights: every
                    expert's gate/up projection column parallel and its down projection row
                    parallel (one all-reduce for the whole block)
``"sharded_norm"``  an RMSNorm over a column layer's sharded output (OLMo 2's q/k norms): its
                    weight is split like the features and the mean square is all-reduced
``"per_head"``      a replicated module applied to each local head (Qwen 3's and Gemma 3's q/k
                    norms over ``head_dim``): kept whole, its gradients summed over the TP ranks
                    (each rank sees only its own heads)
``"replicate"``     left as is (documentation; unmatched modules are replicated)

plus the per-rank attributes to divide (head counts, fused split sizes), the
*regions* (column -> local -> row blocks, for overlap and sequence parallel),
and where sequence parallelism starts. A user plan for their own model is a
few lines::

    plan = TPPlan(name="mine", layers={"layers.*.fc1": "column", "layers.*.fc2": "row"},
                  regions=("layers.*",))

This module does not import transformers; plans for its families refer to its
classes by name only.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

STYLES = (
    "column",
    "column_qkv",
    "row",
    "vocab",
    "lm_head",
    "experts",
    "sharded_norm",
    "per_head",
    "replicate",
)

MODULE_KINDS = ("linear", "embedding", "scaled_embedding")
"""What a plan may declare a module class to be, when its forward is not the stock one:
``linear`` (computes ``x W^T + b``), ``embedding`` (a plain lookup), ``scaled_embedding``
(a lookup times the module's ``embed_scale``)."""

_PATTERN_TUPLES = (
    "regions",
    "sequence_scatter",
    "sequence_gather",
    "sequence_full",
    "rng_regions",
    "optional",
    "trace_leaves",
)
"""The plan fields that are tuples of module-name patterns."""

SectionSpec = int | tuple[int, ...] | str | Callable[[nn.Module], tuple[int, ...]]
"""Sections of a fused column layer: an equal count, the full sizes, an expression over
``model.config`` attributes (``"num_attention_heads*head_dim, num_key_value_heads*head_dim, ..."``)
or a function of the root model returning the sizes. ``head_dim`` left unset in a config means
``hidden_size // num_attention_heads``."""


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """How to tensor-parallelize one model family."""

    name: str
    """Registry name of the plan."""
    layers: Mapping[str, str]
    """Module-name pattern -> style (one of ``STYLES``); the first matching pattern wins."""
    sections: Mapping[str, SectionSpec] = field(default_factory=dict)
    """Module-name pattern -> sections of a fused column layer (see ``SectionSpec``)."""
    attributes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Module-name pattern -> names of integer attributes divided by the TP size (head counts...).
    Every named attribute must exist on every matching module."""
    module_kinds: Mapping[str, str] = field(default_factory=dict)
    """Class name -> one of ``MODULE_KINDS``: classes whose forward is not ``nn.Linear``'s or
    ``nn.Embedding``'s but that the plan knows how to shard exactly."""
    regions: tuple[str, ...] = ()
    """Patterns of modules that are 'column layers -> local compute -> one row layer' blocks."""
    sequence_scatter: tuple[str, ...] = ()
    """Patterns of modules whose first input enters sequence parallelism (split along the sequence)."""
    sequence_gather: tuple[str, ...] = ()
    """Patterns of modules whose first input leaves sequence parallelism (all-gathered). Empty: the
    LM head (a column layer) gathers the sequence itself."""
    sequence_full: tuple[str, ...] = ()
    """Patterns of modules that run on the full sequence: before ``sequence_scatter`` or from
    ``sequence_gather`` on (their replicated parameters' gradients are already complete)."""
    rng_regions: tuple[str, ...] = ()
    """Patterns of regions whose dropout acts only on sharded activations (e.g. attention probabilities
    of the local heads): with ``parallelize(..., rng_tracker=...)`` they run inside ``fork("tp")``. A
    region that drops a replicated tensor (dropout after its row layer) must not be listed."""
    optional: tuple[str, ...] = ()
    """Patterns (of ``layers``, ``attributes`` or ``regions``) allowed to match no module (an LM
    head absent from a headless model). Every other pattern must match at least one module."""
    sequence_parallel: bool = True
    """Whether the plan supports ``sequence_parallel=True``."""
    sequence_parallel_note: str = ""
    """Why it does not (named in the error for ``sequence_parallel=True``)."""
    trace_leaves: tuple[str, ...] = ()
    """Patterns of modules a pipeline tracer keeps opaque even without TP: code that ``torch.export``
    cannot trace (data-dependent shapes inside) but whose outputs' shapes follow from its inputs'
    (a mixture-of-experts block: routed tokens inside, ``[tokens, hidden]`` out). See ``trace_leaf_names``."""
    vocab_parallel_loss: bool = False
    """Leave the LM head's logits vocab-sharded (use ``vocab_parallel_cross_entropy``)."""
    fixup: Callable[[nn.Module, str, int], None] | None = None
    """Called as ``fixup(module, name, tp)`` for every module after sharding, to fix other attributes."""
    check: Callable[[nn.Module, int], None] | None = None
    """Called as ``check(model, tp)`` before anything changes; raises ``ValueError`` for a model the
    plan cannot shard exactly (e.g. fewer key/value heads than ranks)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TPPlan.name must be a non-empty string")
        bad = {p: s for p, s in self.layers.items() if s not in STYLES}
        if bad:
            raise ValueError(f"TPPlan {self.name!r}: unknown styles {bad}; expected one of {STYLES}")
        kinds = {c: k for c, k in self.module_kinds.items() if k not in MODULE_KINDS}
        if kinds:
            raise ValueError(
                f"TPPlan {self.name!r}: unknown module kinds {kinds}; expected one of {MODULE_KINDS}"
            )
        for pattern in self.sections:
            if self.layers.get(pattern) not in ("column", "lm_head"):
                raise ValueError(
                    f"TPPlan {self.name!r}: sections for {pattern!r}, which is not a 'column' pattern "
                    "of layers; give the sections under the same pattern as the column style"
                )
        for what in _PATTERN_TUPLES:
            value = getattr(self, what)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"TPPlan {self.name!r}: {what}={value!r} must be a tuple of pattern strings")

    def with_options(self, **changes: Any) -> TPPlan:
        """A copy with some fields changed (e.g. ``vocab_parallel_loss=True``)."""
        return dataclasses.replace(self, **changes)


_PLANS: dict[str, TPPlan] = {}
_BY_TYPE: dict[str, str] = {}
_BY_CLASS: dict[type, str] = {}


def register_plan(
    plan: TPPlan,
    *,
    model_types: tuple[str, ...] = (),
    classes: tuple[type, ...] = (),
    overwrite: bool = False,
) -> TPPlan:
    """Register ``plan`` under its name; the default for transformers ``model_type``s and for ``classes``.

    ``classes`` match by identity (a subclass of a registered class matches too), never by name.
    """
    if isinstance(model_types, str) or not all(isinstance(t, str) for t in model_types):
        raise ValueError(f"model_types={model_types!r}: expected a tuple of transformers model_type strings")
    if not all(isinstance(c, type) for c in classes):
        raise ValueError(f"classes={classes!r}: expected a tuple of nn.Module classes (not names)")
    if plan.name in _PLANS and not overwrite:
        raise ValueError(f"a TP plan named {plan.name!r} exists; pass overwrite=True to replace it")
    _PLANS[plan.name] = plan
    for t in model_types:
        _BY_TYPE[t] = plan.name
    for c in classes:
        _BY_CLASS[c] = plan.name
    return plan


def list_plans() -> dict[str, tuple[str, ...]]:
    """Registered plan names -> the model types and class names they are the default for."""
    out: dict[str, list[str]] = {name: [] for name in sorted(_PLANS)}
    for t, name in _BY_TYPE.items():
        out[name].append(t)
    for c, name in _BY_CLASS.items():
        out[name].append(c.__qualname__)
    return {name: tuple(sorted(v)) for name, v in out.items()}


def get_plan(name: str) -> TPPlan:
    """The registered plan called ``name``."""
    if name not in _PLANS:
        close = difflib.get_close_matches(name, list(_PLANS), n=3)
        hint = f" (closest: {close})" if close else ""
        raise ValueError(
            f"unknown TP plan {name!r}{hint}; registered plans: {sorted(_PLANS)}. A plan defined "
            "in your code is registered with merak_tp.register_plan(...) when its module is imported"
        )
    return _PLANS[name]


def plan_for_model(model: nn.Module) -> TPPlan:
    """The default plan for ``model``: by registered class, then by ``model.config.model_type``."""
    for cls in type(model).__mro__:
        if cls in _BY_CLASS:
            return _PLANS[_BY_CLASS[cls]]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type in _BY_TYPE:
        return _PLANS[_BY_TYPE[model_type]]
    raise ValueError(
        f"no built-in TP plan for {type(model).__name__} (model_type={model_type!r}); built-in plans cover the "
        f"transformers model types {sorted(_BY_TYPE)}. Name a plan in the job file's training.tp_plan key "
        f"(registered plans: {sorted(_PLANS)}), or write one: training.tp_plan: {{layers: {{pattern: style}}, "
        "...} (styles: " + ", ".join(STYLES) + "). Write a TPPlan(...) in Python and pass it as "
        "parallelize(model, plan, group=...) or register it with register_plan(plan, model_types=(...,), "
        "classes=(...,))"
    )


def trace_leaf_names(model: nn.Module, plan: TPPlan | None = None) -> list[str]:
    """Names of ``model``'s modules matching ``plan.trace_leaves`` (default: the model's built-in plan, if any).

    For a pipeline tracer's ``leaf_modules`` when the model is not tensor parallel (TP's own
    modules are leaves already). A model without a plan has none.
    """
    import fnmatch

    if plan is None:
        try:
            plan = plan_for_model(model)
        except ValueError:
            return []
    names: list[str] = []
    for name, _ in model.named_modules():
        if (
            name
            and any(fnmatch.fnmatchcase(name, p) for p in plan.trace_leaves)
            and not any(name.startswith(n + ".") for n in names)
        ):
            names.append(name)
    return names


# --------------------------------------------------------------------------- plans as plain data

_MAPPING_KEYS = {
    "name",
    "layers",
    "sections",
    "attributes",
    "module_kinds",
    *_PATTERN_TUPLES,
    "sequence_parallel",
    "vocab_parallel_loss",
    "base",
}


def _tuple_of_str(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"tp_plan {key}={value!r}: expected a list of module-name patterns")
    return tuple(value)


def _sections_value(pattern: str, value: Any) -> SectionSpec:
    if isinstance(value, bool):
        raise ValueError(f"tp_plan sections[{pattern!r}]={value!r}: expected a count, sizes or an expression")
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, str)) and not isinstance(v, bool) for v in value
    ):
        if all(isinstance(v, int) for v in value):
            return tuple(value)
        return ", ".join(str(v) for v in value)
    if isinstance(value, str):
        return value
    raise ValueError(
        f"tp_plan sections[{pattern!r}]={value!r}: expected a count (3), sizes ([64, 16, 16]) or "
        "config expressions (['num_attention_heads*head_dim', 'num_key_value_heads*head_dim', ...])"
    )


def plan_from_mapping(data: Mapping[str, Any], *, name: str = "user", check_only: bool = False) -> TPPlan:
    """A plan from plain data (a job file's ``training.tp_plan``).

    Either ``{pattern: style}`` (layers only), or the full vocabulary: ``layers``,
    ``sections``, ``attributes`` (pattern -> list of names), ``module_kinds``, ``regions``,
    ``sequence_scatter`` / ``sequence_gather`` / ``sequence_full``, ``rng_regions``,
    ``optional``, ``trace_leaves``, ``sequence_parallel``, ``vocab_parallel_loss`` and ``base`` (a registered
    plan whose fields the others replace). Raises ``ValueError`` naming the bad key or value.
    ``check_only``: validate before the job's modules are imported (a ``base`` not registered
    yet is skipped, the layers may then come from it).
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"tp_plan={data!r}: expected a mapping")
    if "layers" not in data and "base" not in data:
        data = {"layers": data}
    unknown = sorted(set(data) - _MAPPING_KEYS)
    if unknown:
        close = {k: difflib.get_close_matches(k, sorted(_MAPPING_KEYS), n=1) for k in unknown}
        raise ValueError(
            f"tp_plan: unknown keys {unknown} (closest: {close}); expected keys from {sorted(_MAPPING_KEYS)}"
        )
    fields = _base_fields(data, check_only)
    fields["name"] = str(data.get("name", name))
    fields.update(_mapping_fields(data))
    for key in _PATTERN_TUPLES:
        if key in data:
            fields[key] = _tuple_of_str(key, data[key])
    for key in ("sequence_parallel", "vocab_parallel_loss"):
        if key in data:
            if not isinstance(data[key], bool):
                raise ValueError(f"tp_plan {key}={data[key]!r}: expected true or false")
            fields[key] = data[key]
    if "layers" not in fields:
        raise ValueError("tp_plan: no layers (give layers: {pattern: style} or base: <plan name>)")
    return TPPlan(**fields)


def _base_fields(data: Mapping[str, Any], check_only: bool) -> dict[str, Any]:
    """The fields of the registered plan named by ``base`` (none without it)."""
    fields: dict[str, Any] = {}
    if "base" in data:
        if not isinstance(data["base"], str):
            raise ValueError(f"tp_plan base={data['base']!r}: expected the name of a registered plan")
        if data["base"] in _PLANS or not check_only:
            fields = {f.name: getattr(get_plan(data["base"]), f.name) for f in dataclasses.fields(TPPlan)}
        else:
            fields = {"layers": {}}
    return fields


def _mapping_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The mapping-valued keys (layers, sections, attributes, module_kinds), each checked."""
    fields: dict[str, Any] = {}
    if "layers" in data:
        layers = data["layers"]
        if not isinstance(layers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in layers.items()
        ):
            raise ValueError(
                f"tp_plan layers={layers!r}: expected a mapping of module-name pattern to a style name "
                f"(one of {STYLES})"
            )
        fields["layers"] = dict(layers)
    if "sections" in data:
        if not isinstance(data["sections"], Mapping):
            raise ValueError(
                f"tp_plan sections={data['sections']!r}: expected a mapping of pattern to sections"
            )
        fields["sections"] = {str(k): _sections_value(str(k), v) for k, v in data["sections"].items()}
    if "attributes" in data:
        attrs = data["attributes"]
        if not isinstance(attrs, Mapping):
            raise ValueError(
                f"tp_plan attributes={attrs!r}: expected a mapping of pattern to attribute names"
            )
        fields["attributes"] = {str(k): _tuple_of_str(f"attributes[{k!r}]", v) for k, v in attrs.items()}
    if "module_kinds" in data:
        kinds = data["module_kinds"]
        if not isinstance(kinds, Mapping) or not all(isinstance(v, str) for v in kinds.values()):
            raise ValueError(
                f"tp_plan module_kinds={kinds!r}: expected a mapping of class name to one of {MODULE_KINDS}"
            )
        fields["module_kinds"] = dict(kinds)
    return fields


def resolve_sections(spec: SectionSpec, model: nn.Module, name: str) -> int | tuple[int, ...]:
    """The sections of layer ``name`` from a plan's ``SectionSpec`` (expressions read ``model.config``)."""
    if callable(spec):
        return tuple(int(v) for v in spec(model))
    if not isinstance(spec, str):
        return spec
    config = getattr(model, "config", None)
    sizes = []
    for term in spec.split(","):
        value = 1
        for factor in term.split("*"):
            factor = factor.strip()
            if factor.isdigit():
                value *= int(factor)
                continue
            got = getattr(config, factor, None)
            heads = getattr(config, "num_attention_heads", None)
            if factor == "head_dim" and got is None and isinstance(heads, int):
                got = getattr(config, "hidden_size", 0) // heads  # configs that leave it implicit
            if not isinstance(got, int) or isinstance(got, bool):
                raise ValueError(
                    f"{name}: sections {spec!r}: model.config.{factor} is {got!r}, expected an integer "
                    "(sections expressions multiply integer attributes of model.config)"
                )
            value *= got
        sizes.append(value)
    return tuple(sizes)
