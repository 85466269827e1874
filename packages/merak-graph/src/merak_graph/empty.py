"""Build models on the meta device and materialise (parts of) them later.

``empty_init()`` is a context in which every parameter and buffer registered by
any module constructor lands on the meta device, whatever the module type (the
constructor still runs normally, so ties such as ``lm_head.weight =
wte.weight`` survive). Constructors that compute a buffer's value (rotary
tables, position ids) would lose it on meta, so a small buffer's real value is
remembered on the CPU and restored by ``materialize``.

``materialize(module, device=...)`` gives every meta tensor of ``module`` real
storage on ``device`` and fills it, in order of preference, from a state dict,
from a safetensors file (reading only the tensors this module holds), from the
remembered constructor value of a buffer, or from the modules' own
initialisers (``init_fn(module)`` such as a transformers model's
``_init_weights``, else ``module.reset_parameters()``). Tied tensors stay tied.

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

__all__ = ["empty_init", "materialize", "is_meta_module"]

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
                new_data = torch.empty(old.shape, dtype=old.dtype, device=device)
                if value is not None:
                    if tuple(value.shape) != tuple(old.shape):
                        raise ValueError(
                            f"tensor {key!r} has shape {tuple(value.shape)} in the checkpoint but "
                            f"{tuple(old.shape)} in the model: load a checkpoint of this model configuration"
                        )
                    with torch.no_grad():
                        new_data.copy_(value)
                else:
                    needs_init[id(mod)] = mod
                    if kind == "_parameters":
                        missing.append(key)
                new: torch.Tensor
                if kind == "_parameters":
                    new = type(old)(new_data, requires_grad=old.requires_grad)
                    new.__dict__.update(old.__dict__)
                else:
                    new = new_data
                if value is not None:
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
    if reader is not None:
        logger.debug("materialize read %d tensors from %s", len(reader.read), safetensors_path)
    return module


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
