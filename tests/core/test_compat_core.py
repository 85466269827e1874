"""merak-core's private torch APIs other than FSDP2's, each removed in turn (issue 25, item 2).

- ``torch.distributed.distributed_c10d._get_default_store`` (the heartbeat's store): without it the
  store torchrun serves is reached through ``MASTER_ADDR``/``MASTER_PORT``, and a heartbeat beating
  there is seen by a rank reading the same store;
- ``torch.testing._internal.distributed.fake_pg`` (the dry run's groups and the TP-plan launch
  check): without it the dry run computes the groups from the rank formula, the same groups the
  real layout code builds over the fake process group.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from merak_core.parallel import _compat
from merak_core.planner.dryrun import _build_groups
from merak_core.run.stall import Heartbeat


def test_heartbeat_store_without_the_private_accessor(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # as under torchrun: a client of its store
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
    try:
        assert _compat.default_store() is not None  # torch's accessor, present on this torch
        monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
        store = _compat.default_store()
        assert store is not None, "no store without the private accessor"
        store.set("probe", "1")
        assert dist.PrefixStore("merak", server).get("probe") == b"1", (
            "the fallback store is not the launcher's store"
        )
        beating = Heartbeat(1, 2, interval_s=0.1).start()  # store: the fallback
        try:
            reader = Heartbeat(0, 2, interval_s=0.1, store=dist.PrefixStore("merak", server))
            assert reader.unresponsive() == [], "a rank beating through the fallback store is not seen"
        finally:
            beating.stop()
        assert beating.store is not None
    finally:
        dist.destroy_process_group()


def test_no_fallback_store_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert _compat.default_store() is None
    assert Heartbeat(0, 2, interval_s=0.1).start()._thread is None  # nothing to beat on: no thread


def test_dry_run_groups_without_the_fake_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    if dist.is_initialized():
        pytest.skip("needs a process without a process group")
    built, how = _build_groups(8, 2, 2, 2, list(range(8)))
    assert how.startswith("torch fake process group")
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)  # import fails
    assert _compat.fake_process_group_store() is None
    computed, how = _build_groups(8, 2, 2, 2, list(range(8)))
    assert how.startswith("computed from the rank formula")
    assert computed == built
