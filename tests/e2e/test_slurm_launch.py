"""``merak train --slurm`` on two faked Slurm "nodes" of this machine trains as one 4-rank node does.

What ``srun --nodes=2 --ntasks-per-node=1 merak train --slurm JOB`` would start
(``examples/slurm/train.sbatch``): two ``merak train --slurm`` processes whose environments differ
only in ``SLURM_NODEID`` (0 and 1), with ``SLURM_JOB_NODELIST=localhost,localhost`` (expanded
without ``scontrol``), ``SLURM_JOB_NUM_NODES=2``, ``SLURM_JOB_ID`` and ``MERAK_RDZV_PORT`` a free port.
Each derives ``--nnodes 2 --node-rank i --rdzv-endpoint localhost:PORT --rdzv-id slurm-ID`` and
starts 2 ranks; the two torchrun agents meet at the c10d rendezvous, agree on global ranks 0-3 and
train the tiny job of ``test_multinode.py`` at dp=1 tp=2 pp=2 (tensor parallelism inside a node,
the pipeline across the two). The same job's 4 ranks on one node (in the worker pool, set up as
``merak_core.launch`` sets up torchrun's) run after them; the per-step and evaluation losses must agree to float64 round-off. This is the one real
multi-node job of the suite: flags given by hand (``--nnodes`` ...) build the same torchrun command
(``test_multinode.py``).
"""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path

import pytest

from tests.e2e import _fault_support as faults
from tests.e2e.test_multinode import FACTORIES, JOB, REPO, STEPS, _free_port, _merak, _metrics, _wait
from tests.support.dist import run_on_ranks


@pytest.mark.slow
def test_two_faked_slurm_nodes_match_one_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB % {"steps": STEPS})
    (tmp_path / "factories.py").write_text(textwrap.dedent(FACTORIES % {"repo": str(REPO)}))
    logs = {name: tmp_path / f"{name}.log" for name in ("node0", "node1")}
    procs = {}
    job_id = uuid.uuid4().hex[:8]
    monkeypatch.setenv("SLURM_JOB_ID", job_id)
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost,localhost")
    monkeypatch.setenv("MERAK_RDZV_PORT", str(_free_port()))
    for node in (0, 1):
        monkeypatch.setenv("SLURM_NODEID", str(node))  # _merak copies the environment when it starts
        procs[f"node{node}"] = _merak(job, tmp_path / "slurm", "--slurm", log=logs[f"node{node}"])
    _wait(procs, logs)
    # The one-node reference: the same job file's 4 ranks in the worker pool, set up as merak_core.launch
    # sets up torchrun's (the launch is what the two nodes check; a third torchrun job cost the line's
    # time: 22 s of this test's 55 s alone, several times that beside the in-pool tests).
    for name in (
        "SLURM_JOB_ID",
        "SLURM_JOB_NUM_NODES",
        "SLURM_JOB_NODELIST",
        "MERAK_RDZV_PORT",
        "SLURM_NODEID",
    ):
        monkeypatch.delenv(name)  # a pool started now must not see the faked Slurm job
    run_on_ranks(4, faults.job_ranks_body, str(job), [f"training.output_dir={tmp_path / 'one_node'}"])

    for node in (0, 1):
        text = logs[f"node{node}"].read_text()
        expected = (
            "--nnodes=2",
            f"--node-rank={node}",
            "--rdzv-endpoint=localhost:",
            f"--rdzv-id=slurm-{job_id}",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
        )
        assert all(flag in text for flag in expected), text[-2000:]
    summary = json.loads((tmp_path / "slurm" / "summary.json").read_text())
    assert summary["steps"] == STEPS and "/4 dp=1 tp=2 pp=2" in summary["layout"], summary

    one_losses, one_eval = _metrics(tmp_path / "one_node")
    slurm_losses, slurm_eval = _metrics(tmp_path / "slurm")
    assert all(loss == loss and abs(loss) < float("inf") for loss in slurm_losses), slurm_losses
    assert slurm_losses == pytest.approx(one_losses, rel=1e-12, abs=0.0)
    assert slurm_eval["eval_loss"] == pytest.approx(one_eval["eval_loss"], rel=1e-12, abs=0.0)
    assert slurm_eval["eval_accuracy"] == one_eval["eval_accuracy"]
    assert len(set(one_losses)) == STEPS, f"the loss did not change between steps: {one_losses}"
