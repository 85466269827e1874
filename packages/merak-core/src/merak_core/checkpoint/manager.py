"""CheckpointManager: save and load a run's whole state (:class:`CheckpointParts`) with DCP, any layout to any layout.

See the package docstring (``merak_core.checkpoint``) for the keys, the atomic
commit, the manifest and the ``latest`` pointer. The manager knows where a run's
checkpoints live and which one a path means; saving is ``save.py``, loading ``load.py``.

Not done here: shard specs (``specs.py``), files and pointers (``files.py``),
checksums and finiteness (``integrity.py``), RNG and hyper-parameters (``state.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from merak_core.checkpoint.files import CheckpointCorruptError, CheckpointError, _step_dirs, latest_candidates
from merak_core.checkpoint.load import checkpoint_candidates, load_checkpoint, place_optimizer_state
from merak_core.checkpoint.ranks import warn_rank0
from merak_core.checkpoint.save import NonFiniteCheckpointError, save_checkpoint
from merak_core.checkpoint.specs import model_fingerprint

if TYPE_CHECKING:
    from merak_core.checkpoint.parts import CheckpointParts

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "NonFiniteCheckpointError", "place_optimizer_state"]


class CheckpointManager:
    """Save and load the explicit state of a run, :class:`CheckpointParts` (see the package docstring).

    Collective: every rank calls ``save``/``load`` at the same point. Checkpoints go to
    ``args.output_dir/checkpoints``; ``save_total_limit`` bounds how many are kept.
    """

    def __init__(self, parts: CheckpointParts) -> None:
        self.parts = parts
        self._fingerprint: dict[str, tuple[int, ...]] | None = None

    @property
    def root(self) -> Path:
        """The directory holding ``step_<N>`` checkpoints and the ``latest`` pointer."""
        return Path(self.parts.args.output_dir) / "checkpoints"

    def checkpoints(self) -> list[Path]:
        """Committed checkpoint directories, oldest first."""
        return [p for _, p in _step_dirs(self.root)]

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points to (the newest committed one if the pointer is missing).

        Only what is on disk is looked at; :meth:`load` verifies the files and falls back
        to older checkpoints when this one is corrupt.
        """
        candidates = latest_candidates(self.root)
        return candidates[0] if candidates else None

    def check_fresh_start(self) -> None:
        """CheckpointError when this run starts at step 0, saves checkpoints, and ``output_dir`` holds an earlier run's."""
        args = self.parts.args
        if not args.save_steps or self.parts.train.global_step != 0:
            return
        earlier = self.checkpoints()
        if earlier:
            raise CheckpointError(
                f"output_dir {args.output_dir!r} already holds checkpoints {[p.name for p in earlier]} of an "
                f"earlier run, which this run (not resumed, save_steps={args.save_steps}) would overwrite: "
                "resume it with trainer.resume('latest') (merak train --resume latest), or choose a new output_dir"
            )

    def fingerprint(self) -> dict[str, tuple[int, ...]]:
        """Every logical parameter name with its full shape, over all stages (collective once, then cached)."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.parts)
        return self._fingerprint

    # ------------------------------------------------------------------ save

    def save(self) -> Path:
        """Write ``step_<global_step>`` (see [Note: atomic commit]); returns the committed directory.

        Raises :class:`NonFiniteCheckpointError` on every rank, before anything is written,
        when a parameter or optimizer state holds NaN or inf (see [Note: finite checkpoints]).
        """
        return save_checkpoint(self.parts, self.root, self.fingerprint())

    # ------------------------------------------------------------------ load

    def resolve(self, path: str | os.PathLike[str] = "latest") -> Path | None:
        """The checkpoint directory for ``path`` as found on disk (no verification, no collectives).

        ``path``: ``latest`` or ``auto`` (in ``output_dir``; ``auto`` gives None when there is
        none), a ``.../checkpoints/latest`` pointer, a checkpoints directory, or a checkpoint
        directory. :meth:`load` verifies and falls back from a corrupt ``latest``.
        """
        candidates, is_latest = checkpoint_candidates(self.root, path)
        if not candidates:
            if str(path) == "auto":
                return None
            raise CheckpointError(
                f"no checkpoint to resume from: {str(self.root)!r} holds no committed step_<N> directory "
                "(set save_steps to write checkpoints, or pass a checkpoint directory)"
            )
        return candidates[0]

    def load(self, path: str | os.PathLike[str] = "latest") -> int:
        """Restore everything saved by :meth:`save` (any layout); returns the checkpoint's step.

        ``path``: see :meth:`resolve`. For ``latest`` (and ``auto``), a checkpoint whose files
        fail verification is skipped with a warning naming it and the next older one is
        tried; a named directory that fails raises :class:`CheckpointCorruptError`.
        """
        if self.resolve(path) is None:
            logger.info("resume=auto: no checkpoint under %s, starting from scratch", self.root)
            return self.parts.train.global_step
        candidates, is_latest = checkpoint_candidates(self.root, path, warn=True)
        skipped: list[str] = []
        for directory in candidates:
            try:
                return load_checkpoint(self.parts, directory, self.fingerprint)
            except CheckpointCorruptError as exc:
                if not is_latest:
                    raise
                skipped.append(f"{directory.name}: {exc}")
                warn_rank0(
                    "resume %s: skipping checkpoint %s, it fails verification: %s", path, directory, exc
                )
        raise CheckpointCorruptError(
            f"no checkpoint under {str(candidates[0].parent)!r} verifies; skipped: " + " | ".join(skipped)
        )
