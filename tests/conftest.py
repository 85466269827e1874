"""Session-wide test set-up: one thread per process, one scratch folder, worker pools shut down at exit.

Every temporary file of the session (``tempfile`` in this process, in the forked worker ranks,
and in subprocesses such as torchrun through ``TMPDIR``) goes under one folder that is removed
when the session ends, so test runs leave nothing behind in the system temp folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_SCRATCH = tempfile.mkdtemp(prefix="merak-tests-")
os.environ["TMPDIR"] = _SCRATCH
tempfile.tempdir = _SCRATCH

# Must happen before torch starts its thread pools (workers are forked from us).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU machines)")
    config.addinivalue_line("markers", "world8: uses the 8-rank worker pool")
    config.addinivalue_line("markers", "transformers: needs the optional transformers package")
    config.addinivalue_line("markers", "slow: starts subprocesses (merak train / torchrun); seconds per test")
    config.addinivalue_line(
        "markers",
        "one_process: a slow test whose subprocess is one process, no torchrun job and no ranks: it runs "
        "beside the line of jobs, on any worker (see [Note: subprocess tests in one line])",
    )


# [Note: subprocess tests in one line]
# A ``slow`` test starts ``merak train`` / torchrun, whose ranks import torch and merak-core and build
# their model from nothing. Two such jobs side by side on a 2-core machine slowed each other several
# times over (test_signals[rank1]: 26 s alone, 218 s next to another 8-rank job) and made their
# timeouts fire. So the ``slow`` tests form one pytest-xdist group (``--dist loadgroup``: one worker
# runs them one after another) and come first in the collection, so that this worker starts them at
# once while the others run the in-pool tests; the run ends when both lines end.
# pytest-xdist reads a test's group from its node id (``...@group``), which its own hook writes into
# ``item._nodeid``; pytest 9.2 keeps the id in ``item._id`` and ignores that write (pytest-xdist issue
# 1386), and the slow tests ran on both workers, two jobs at once. ``_join_the_group`` writes it there.
# Only the multi-process jobs are in the line: a ``slow`` test also marked ``one_process`` starts one
# process (a ``merak train`` that refuses the job before launching, one rank's set-up, the GPU check's
# entry on CPU, a bash script). That is less than an in-pool test beside the line (up to 8 ranks), so
# such tests run on any worker, after the line's jobs in the collection (7 of the line's 21 tests, 92 s
# of its 1458 s one after another at load 14-24; docs/testing.md).
SUBPROCESS_GROUP = "subprocess-jobs"


def _join_the_group(item: pytest.Item) -> None:
    """Put ``@SUBPROCESS_GROUP`` at the end of the node id where pytest keeps it (pytest >= 9.2)."""
    suffix = "@" + SUBPROCESS_GROUP
    if item.nodeid.endswith(suffix) or not hasattr(item, "_id"):
        return  # older pytest: pytest-xdist's own hook does it
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:
        return
    item._id = coerce_node_id(item.nodeid + suffix)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        jobs = [item for item in slow if item.get_closest_marker("one_process") is None]
        for item in jobs:
            item.add_marker(pytest.mark.xdist_group(SUBPROCESS_GROUP))
            if getattr(config.option, "loadgroup", False):  # a pytest-xdist worker under --dist loadgroup
                _join_the_group(item)
        slow = jobs + [item for item in slow if item.get_closest_marker("one_process") is not None]
        ids = {id(item) for item in slow}
        items[:] = slow + [item for item in items if id(item) not in ids]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not any node named "gpu" (tests/gpu/)
            item.add_marker(skip)


# [Note: the subprocess jobs first, by priority too]
# The worker that runs the ``slow`` group spends most of its wall time in what its jobs run in this
# process's session: ``merak train``'s checks before torchrun (imports, the model built and traced),
# the in-process references, the pool bodies of a test. Those compete with the other worker and its
# pool ranks (up to 8 processes) for the same CPU share, and the one line of subprocess jobs became
# most of CI's time (test_cli_signals' SIGKILL test: 9 s alone, 125 s in CI). So a worker lowers its
# own priority (nice 10) before its first in-pool test: its pool ranks and subprocesses inherit it,
# and the subprocess jobs' processes, at the normal priority, go first. Only our own processes are
# lowered; raising a nice value needs no privilege. torchrun's ranks run in a session of their own
# (``merak_core.cli.supervise``), which the kernel already schedules as its own group.
BACKGROUND_NICE = 10


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ or item.get_closest_marker("slow") is not None:
        return
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) < BACKGROUND_NICE:
            os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICE)
    except OSError:  # a platform without priorities: run as before
        pass


def pytest_runtest_teardown(item: pytest.Item) -> None:
    from tests.support.dist import recycle_pools

    recycle_pools()  # between tests only: see [Note: pool recycling] in tests/support/dist.py


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.support.dist import shutdown_pools

    shutdown_pools()
    shutil.rmtree(_SCRATCH, ignore_errors=True)
