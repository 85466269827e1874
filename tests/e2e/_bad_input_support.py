"""Machinery of the bad-input table: a no-collective guard and running one case on ranks.

[Note: before any collective] Every case runs the faulty call inside :func:`no_collectives`,
which swaps the collective and p2p functions of ``torch.distributed`` (and
``init_process_group``) for stubs that raise :class:`CollectiveCalled`. A case whose error
comes only after some process-group work therefore fails with ``CollectiveCalled`` instead
of the expected error. Set-up that a user would do before the mistake (``init``, building a
layout) runs outside the guard.

Multi-rank cases run through ``tests.support.dist.run_on_ranks``: each rank catches its own
exception and returns ``(module, qualname, message)`` (so the pooled workers survive), and
:func:`reraise_agreed` checks that every rank raised the same exception type before
re-raising it in the test process, where ``pytest.raises(..., match=...)`` checks it.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

GUARDED = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "init_process_group",
)
"""``torch.distributed`` functions a bad input must never reach."""


class CollectiveCalled(AssertionError):
    """A case reached process-group work before raising its error."""


class CliExit(Exception):
    """``merak`` exited with an error: the message is the exit status and what it printed to stderr."""


@contextlib.contextmanager
def no_collectives(allow: tuple[str, ...] = ()) -> Iterator[None]:
    """Make every function in :data:`GUARDED` but ``allow`` raise :class:`CollectiveCalled`.

    See [Note: before any collective]; ``allow`` is for the few errors that need agreed metadata first.
    """
    saved: dict[str, Any] = {}

    def stub_for(name: str) -> Callable[..., Any]:
        def stub(*args: Any, **kwargs: Any) -> Any:
            raise CollectiveCalled(f"torch.distributed.{name} was called before the bad input was reported")

        return stub

    for name in GUARDED:
        if hasattr(dist, name) and name not in allow:
            saved[name] = getattr(dist, name)
            setattr(dist, name, stub_for(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def dry_run_train(job: Path, *argv: str) -> tuple[int, str]:
    """``merak train JOB ARGV --dry-run`` in this process, every collective but ``init_process_group`` refused:
    (exit status, what it printed to stderr)."""
    from merak_core.cli import main

    err = io.StringIO()
    with (
        no_collectives(allow=("init_process_group",)),
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            status = main(["--log-level", "WARNING", "train", str(job), *argv, "--dry-run"])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 2
    return status, err.getvalue()


@dataclass
class CaseContext:
    """What a case function gets: a scratch directory (the same one on every rank) and the guard."""

    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="merak-bad-input-")))

    @staticmethod
    def guard(allow: tuple[str, ...] = ()) -> contextlib.AbstractContextManager[None]:
        return no_collectives(allow)


Outcome = tuple[str, str, str] | None
"""``(exception module, qualname, message)`` or None when nothing was raised."""


def run_case_on_rank(module_name: str, fn_name: str, tmp: str) -> Outcome:
    """Worker body: run one case function with scratch directory ``tmp``; return its exception as plain data."""
    fn = getattr(importlib.import_module(module_name), fn_name)
    try:
        fn(CaseContext(Path(tmp)))
    except BaseException as exc:  # noqa: BLE001 - every outcome is reported to the test process
        return type(exc).__module__, type(exc).__qualname__, str(exc)
    return None


def _exception_class(module: str, qualname: str) -> type[BaseException]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def reraise_agreed(outcomes: list[Outcome]) -> None:
    """Every rank must have raised the same exception type; re-raise rank 0's here."""
    silent = [rank for rank, o in enumerate(outcomes) if o is None]
    if silent:
        raise AssertionError(f"ranks {silent} raised nothing (they would go on and hang): {outcomes}")
    kinds = {(o[0], o[1]) for o in outcomes if o is not None}
    if len(kinds) != 1:
        raise AssertionError(f"the ranks disagree on the error: {outcomes}")
    module, qualname, message = outcomes[0]  # type: ignore[misc]
    cls = _exception_class(module, qualname)
    exc = cls.__new__(cls)
    BaseException.__init__(exc, message)
    raise exc
