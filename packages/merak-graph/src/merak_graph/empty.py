"""Build models on the meta device and materialise (parts of) them later.

``empty_init()`` is a context in which every parameter and buffer registered by
any module constructor lands on the meta device, whatever the module type (the
constructor still runs normally, so ties such as ``lm_head.weight =
wte.weight`` survive). Constructors that compute a buffer's value (rotary
tables, position ids) would lose it on meta, so a small buffer's real value is
remembered on the CPU and restored by ``materialize``. [Note: replaced modules] The value is
remembered per module: a module put in another's place after construction (a tensor-parallel
layer copying the original's meta buffers) starts with none, until
``adopt_constructor_buffers`` hands it the value recorded under the same name
(``constructor_buffers`` of the model before the swap). A parameter made in a meta one's
place keeps its gradient hooks ([Note: gradient hooks]).

``materialize(module, device=...)`` gives every meta tensor of ``module`` real
storage on ``device`` and fills it, in order of preference, from a state dict,
from a safetensors file (reading only the tensors this module holds), from the
remembered constructor value of a buffer, or from the modules' own
initialisers (``init_fn(module)`` such as a transformers model's
``_init_weights``, else ``module.reset_parameters()``). Tied tensors stay tied.
A buffer none of these gives a value is an error, never uninitialised memory.

Deliberately not done: sharded (multi-file) safetensors indexes are read one
file at a time by the caller; random initialisation does not reproduce the
random stream of an eager construction.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from merak_graph._compat import carry_grad_hooks

__all__ = [
    "adopt_constructor_buffers",
    "constructor_buffers",
    "empty_init",
    "is_meta_module",
    "materialize",
]

logger = logging.getLogger(__name__)

# Buffers up to this many elements keep their constructor value on the CPU (e.g. rotary tables).
_BUFFER_STASH_MAX_NUMEL = 1 << 24
# module -> {buffer name: CPU value computed by the constructor}
_BUFFER_VALUES: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def empty_init(*, include_buffers: bool = True) -> Iterator[None]:
    """Construct modules with all parameters (and buffers) on the meta device.

    Example::

        with merak_graph.empty_init():
            model = MyHugeModel(config)    # no parameter memory is allocated
    """
    original_param = nn.Module.register_parameter
    original_buffer = nn.Module.register_buffer

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_param(self, name, param)
        param = self._parameters.get(name)
        if param is not None and param.device.type != "meta":
            cls = type(param)
            kwargs = dict(param.__dict__)
            meta = cls(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(kwargs)
            self._parameters[name] = meta

    def register_buffer(
        self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        original_buffer(self, name, tensor, persistent=persistent)
        buf = self._buffers.get(name)
        if include_buffers and buf is not None and buf.device.type != "meta":
            if buf.numel() <= _BUFFER_STASH_MAX_NUMEL:
                _BUFFER_VALUES.setdefault(self, {})[name] = buf.detach().cpu().clone()
            self._buffers[name] = buf.to("meta")

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_param  # type: ignore[method-assign]
        nn.Module.register_buffer = original_buffer  # type: ignore[method-assign]


def is_meta_module(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def stashed_buffer_value(module: nn.Module, name: str) -> torch.Tensor | None:
    """The CPU value a constructor gave buffer ``name`` of ``module`` under ``empty_init``."""
    return _BUFFER_VALUES.get(module, {}).get(name)


def constructor_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The values constructors gave the buffers of ``module`` under ``empty_init``, by qualified name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for name, value in _BUFFER_VALUES.get(mod, {}).items():
            out.setdefault(f"{prefix}.{name}" if prefix else name, value)
    return out


def adopt_constructor_buffers(module: nn.Module, values: Mapping[str, torch.Tensor]) -> list[str]:
    """Give meta buffers of ``module`` that have no remembered value the one ``values`` holds for their name.

    ``values`` comes from :func:`constructor_buffers` of the same model before some of its modules were
    replaced ([Note: replaced modules]); a buffer takes a value only if it is still on the meta device
    and has the recorded shape. Returns the qualified names that took one.
    """
    adopted = []
    for qualified, value in values.items():
        owner_name, _, name = qualified.rpartition(".")
        try:
            owner = module.get_submodule(owner_name) if owner_name else module
        except AttributeError:
            continue
        buf = owner._buffers.get(name)
        stash = _BUFFER_VALUES.get(owner, {})
        if buf is None or not buf.is_meta or name in stash or tuple(buf.shape) != tuple(value.shape):
            continue
        _BUFFER_VALUES.setdefault(owner, {})[name] = value
        adopted.append(qualified)
    return adopted


def _copy_stash(src: nn.Module, dst: nn.Module) -> None:
    if src in _BUFFER_VALUES:
        _BUFFER_VALUES[dst] = dict(_BUFFER_VALUES[src])


class _SafetensorsReader:
    """Reads single tensors from a safetensors file on demand (only the keys asked for)."""

    def __init__(self, path: str, device: torch.device) -> None:
        try:
            from safetensors import safe_open
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "loading from safetensors_path needs the optional 'safetensors' package: "
                "pip install 'merak-graph[safetensors]'"
            ) from exc
        self._file = safe_open(path, framework="pt", device=str(device) if device.type != "meta" else "cpu")
        self.keys = set(self._file.keys())
        self.read: list[str] = []

    def get(self, key: str) -> torch.Tensor | None:
        if key not in self.keys:
            return None
        self.read.append(key)
        return self._file.get_tensor(key)


def materialize(
    module: nn.Module,
    *,
    device: torch.device | str,
    init_fn: Callable[[nn.Module], Any] | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    safetensors_path: str | None = None,
    name_map: Mapping[str, str] | None = None,
    strict: bool = False,
) -> nn.Module:
    """Give every meta parameter/buffer of ``module`` real storage on ``device`` and fill it.

    ``name_map`` maps a tensor's name in ``module`` to its key in ``state_dict`` /
    the safetensors file (e.g. a stage module's local names to the original model's
    names); by default the names are used as they are. With ``strict=True`` every
    parameter must be found in the state dict or file. Tensors already on a real
    device are left alone. Returns ``module`` (changed in place).
    """
    device = torch.device(device)
    name_map = dict(name_map or {})
    reader = _SafetensorsReader(safetensors_path, device) if safetensors_path else None

    replaced: dict[int, torch.Tensor] = {}  # id(old meta tensor) -> new tensor (keeps ties)
    loaded: set[int] = set()  # ids of new tensors filled from a checkpoint or stash
    needs_init: dict[int, nn.Module] = {}  # id(module) -> module whose own tensors need init
    missing: list[str] = []
    unset_buffers: list[tuple[nn.Module, str, str]] = []  # buffers only an initialiser can fill

    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            table: dict[str, Any] = getattr(mod, kind)
            for name, old in list(table.items()):
                if old is None or not old.is_meta:
                    continue
                full = f"{mod_name}.{name}" if mod_name else name
                if id(old) in replaced:
                    table[name] = replaced[id(old)]
                    continue
                key = name_map.get(full, full)
                value = _lookup(key, state_dict, reader)
                if value is None and kind == "_buffers":
                    value = stashed_buffer_value(mod, name)
                new = _real_tensor(old, value, key, device)
                if value is None:
                    needs_init[id(mod)] = mod
                    if kind == "_parameters":
                        missing.append(key)
                    elif _fill_sentinel(new):
                        unset_buffers.append((mod, name, key))
                else:
                    loaded.add(id(new))
                replaced[id(old)] = new
                table[name] = new
    if strict and missing:
        raise ValueError(
            f"{len(missing)} parameters are missing from the checkpoint, e.g. {missing[:5]}: pass a "
            "complete state dict / safetensors file, or strict=False to initialise them"
        )
    for mod in needs_init.values():
        _initialise(mod, init_fn, loaded)
    _check_buffers_set(unset_buffers)
    if reader is not None:
        logger.debug("materialize read %d tensors from %s", len(reader.read), safetensors_path)
    return module


def _real_tensor(
    old: torch.Tensor, value: torch.Tensor | None, key: str, device: torch.device
) -> torch.Tensor:
    """The tensor on ``device`` that replaces meta ``old`` (a parameter stays one), holding ``value`` if given."""
    new_data = torch.empty(old.shape, dtype=old.dtype, device=device)
    if value is not None:
        if tuple(value.shape) != tuple(old.shape):
            raise ValueError(
                f"tensor {key!r} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(old.shape)} in the model: load a checkpoint of this model configuration"
            )
        with torch.no_grad():
            new_data.copy_(value)
    if not isinstance(old, nn.Parameter):
        return new_data
    new = type(old)(new_data, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    _keep_grad_hooks(old, new)
    return new


def _keep_grad_hooks(old: torch.Tensor, new: torch.Tensor) -> None:
    """[Note: gradient hooks] ``new`` replaces ``old``: it runs the gradient hooks registered on ``old``.

    Layers put hooks on their parameters (a tensor-parallel replicated weight whose gradient is
    summed over its group); a tensor made in another's place (materialisation, a stage's copy)
    would otherwise drop them without a word. Through ``_compat.carry_grad_hooks`` (torch's private
    hook table; where it is missing, the hooks recorded on ``old``).
    """
    carry_grad_hooks(old, new)


def _fill_sentinel(t: torch.Tensor) -> bool:
    """Fill a buffer no source gives a value with a marker an initialiser overwrites (False: no marker fits)."""
    if t.numel() == 0 or t.dtype == torch.bool or t.is_complex():
        return False
    with torch.no_grad():
        t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)
    return True


def _check_buffers_set(unset: list[tuple[nn.Module, str, str]]) -> None:
    """[Note: unset buffers] A buffer still holding its marker after initialisation has no value: refuse it."""
    for mod, name, key in unset:
        t = mod._buffers.get(name)
        if t is None or t.is_meta:
            continue
        marker = float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min
        left = bool(torch.isnan(t).all()) if t.is_floating_point() else bool((t == marker).all())
        if left:
            raise ValueError(
                f"buffer {key!r} of {type(mod).__name__} has no value after materialisation: it is not in the "
                "state dict / file, no constructor value was remembered for it under empty_init (a module "
                "put in its original's place after construction needs adopt_constructor_buffers), and the "
                "module's initialiser (init_fn or reset_parameters) did not set it; pass its value, or an "
                "init_fn that sets it"
            )


def _lookup(
    key: str, state_dict: Mapping[str, torch.Tensor] | None, reader: _SafetensorsReader | None
) -> torch.Tensor | None:
    if state_dict is not None and key in state_dict:
        return state_dict[key]
    if reader is not None:
        return reader.get(key)
    return None


def _initialise(mod: nn.Module, init_fn: Callable[[nn.Module], Any] | None, loaded: set[int]) -> None:
    """Run the module's initialiser, then restore the tensors that came from a checkpoint."""
    own = {**mod._parameters, **mod._buffers}
    keep = {n: t.detach().clone() for n, t in own.items() if t is not None and id(t) in loaded}
    with torch.no_grad():
        if init_fn is not None:
            init_fn(mod)
        elif callable(getattr(mod, "reset_parameters", None)):
            getattr(mod, "reset_parameters")()  # noqa: B009
        elif callable(getattr(mod, "_reset_parameters", None)):
            getattr(mod, "_reset_parameters")()  # noqa: B009
        else:
            logger.warning(
                "module %s has no reset_parameters() and no init_fn was given: its tensors %s are left "
                "uninitialised",
                type(mod).__name__,
                sorted(n for n in own if n not in keep),
            )
        for name, value in keep.items():
            current = getattr(mod, name)
            current.copy_(value)
