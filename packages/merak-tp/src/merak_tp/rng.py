"""Explicit random-number state for dropout in tensor-parallel code.

Two kinds of randomness meet in a TP model:

- *replicated* activations (the residual stream, a row layer's output) must be
  dropped identically on every TP rank: use the ordinary default generator,
  seeded with the same seed on every TP rank;
- *sharded* activations (a column layer's output, local attention heads) need
  masks that differ between ranks. ``RNGTracker`` holds named generator states
  (no module-level globals); ``tracker.fork("tp")`` runs a block with the
  "tp" state swapped into the default generator and saves it back afterwards,
  so results are reproducible from the seed and independent of the main stream.

A state added with ``derived=True`` keeps no generator state of its own: each
``fork`` draws one number from the default CPU generator (identical on every TP
rank) and seeds the block's generator from it and the state's seed (different
per TP rank). The masks are then a function of the default generator's state,
so whatever saves and restores that state also replays them: a pipeline stage
that recomputes a checkpointed segment under the saved default state (merak_pipe)
draws the same masks again, and a checkpoint of the default generator resumes
them. This is the mode a trainer with activation recomputation needs.

``sharded_dropout`` is the exact alternative: every rank draws the *full-size*
mask from a generator seeded identically on all ranks and keeps its own block,
so the result equals the single-device model's dropout with that generator
(at the cost of drawing tp times more random numbers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed import ProcessGroup

from merak_tp.collectives import tp_rank, tp_size

__all__ = ["RNGTracker", "sharded_dropout", "tp_seed"]

_TP_SEED_OFFSET = 2718


def tp_seed(base_seed: int, group: ProcessGroup | None) -> int:
    """A seed that differs per TP rank (``base_seed + 2718 + tp_rank``), as Megatron derives it."""
    return base_seed + _TP_SEED_OFFSET + tp_rank(group)


class RNGTracker:
    """Named generator states, forked into the default generator for a ``with`` block.

    ``device`` is the device whose default generator is swapped ("cpu" or a CUDA device).
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}
        self._derived: dict[str, int] = {}

    def add(self, name: str, seed: int, *, derived: bool = False) -> None:
        """Create state ``name`` from ``seed`` (ValueError if the name exists).

        ``derived=True``: no stored state; every fork seeds from one draw of the default CPU
        generator and ``seed`` (see the module docstring).
        """
        if name in self._states or name in self._derived:
            raise ValueError(f"RNG state {name!r} already exists; choose another name or call reset()")
        if derived:
            self._derived[name] = int(seed)
            return
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._states[name] = gen.get_state()

    def __contains__(self, name: object) -> bool:
        return name in self._states or name in self._derived

    def reset(self) -> None:
        """Forget every state."""
        self._states.clear()
        self._derived.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of the stored states (for checkpoints; derived states need none)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states from ``get_states``."""
        self._states = {k: v.clone() for k, v in states.items()}

    def _derive(self, name: str) -> torch.Tensor:
        draw = int(torch.randint(0, 2**62, (1,)).item())  # the default CPU generator: same on all TP ranks
        seed = (draw * 0x9E3779B97F4A7C15 + self._derived[name]) % (2**63)
        return torch.Generator(device=self.device).manual_seed(seed).get_state()

    def _get_rng(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set_rng(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Run the block with state ``name`` as the default generator; the outer state is kept."""
        if name not in self:
            raise ValueError(
                f"RNG state {name!r} is unknown: call tracker.add({name!r}, seed) first "
                f"(known: {sorted([*self._states, *self._derived])})"
            )
        derived = name in self._derived
        inner = self._derive(name) if derived else self._states[name]
        outer = self._get_rng()
        self._set_rng(inner)
        try:
            yield
        finally:
            if not derived:
                self._states[name] = self._get_rng()
            self._set_rng(outer)


def sharded_dropout(
    x_local: torch.Tensor,
    p: float,
    *,
    group: ProcessGroup | None,
    dim: int = -1,
    generator: torch.Generator,
    training: bool = True,
) -> torch.Tensor:
    """Dropout of a tensor sharded along ``dim``, equal to the unsharded dropout's block.

    ``generator`` must be in the same state on every TP rank; the full mask is
    drawn (``tp`` times ``x_local``'s size) and this rank's block kept.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout p={p}: expected 0 <= p < 1")
    if not training or p == 0.0:
        return x_local
    world, rank = tp_size(group), tp_rank(group)
    d = dim % x_local.dim()
    shape = list(x_local.shape)
    shape[d] *= world
    keep = torch.empty(shape, device=x_local.device).bernoulli_(1.0 - p, generator=generator)
    keep_local = keep.chunk(world, dim=d)[rank].to(x_local.dtype)
    return x_local * keep_local / (1.0 - p)
