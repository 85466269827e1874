"""Session-wide test set-up: one thread per process, worker pools shut down at exit."""

from __future__ import annotations

import os

# Must happen before torch starts its thread pools (workers are forked from us).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU machines)")
    config.addinivalue_line("markers", "world8: uses the 8-rank worker pool")
    config.addinivalue_line("markers", "transformers: needs the optional transformers package")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.support.dist import shutdown_pools

    shutdown_pools()
