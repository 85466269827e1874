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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
