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


# [Note: subprocess tests in one line]
# A ``slow`` test starts ``merak train`` / torchrun, whose ranks import torch and merak-core and build
# their model from nothing. Two such jobs side by side on a 2-core machine slowed each other several
# times over (test_signals[rank1]: 26 s alone, 218 s next to another 8-rank job) and made their
# timeouts fire. So the ``slow`` tests form one pytest-xdist group (``--dist loadgroup``: one worker
# runs them one after another) and come first in the collection, so that this worker starts them at
# once while the others run the in-pool tests; the run ends when both lines end.
SUBPROCESS_GROUP = "subprocess-jobs"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        for item in slow:
            item.add_marker(pytest.mark.xdist_group(SUBPROCESS_GROUP))
        ids = {id(item) for item in slow}
        items[:] = slow + [item for item in items if id(item) not in ids]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not any node named "gpu" (tests/gpu/)
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.support.dist import shutdown_pools

    shutdown_pools()
    shutil.rmtree(_SCRATCH, ignore_errors=True)
