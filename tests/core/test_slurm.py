"""``merak train --slurm``: torchrun's multi-node flags derived from Slurm's variables (no Slurm, no process)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from merak_core.cli.main import _build_parser
from merak_core.cli.slurm import SlurmNode, expand_nodelist, slurm_node
from merak_core.cli.train import _from_slurm, torchrun_command

REPO = Path(__file__).resolve().parents[2]

# What srun sets in each task of `srun --nodes=2 --ntasks-per-node=1` on nodes gpu07 and gpu08.
SLURM_2_NODES = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def _flags(tokens: list[str]) -> dict[str, str]:
    return dict(t[2:].split("=", 1) for t in tokens if t.startswith("--") and "=" in t)


@pytest.mark.parametrize("node_id", [0, 1])
def test_two_nodes_give_torchrun_one_rendezvous_and_their_node_rank(node_id: int) -> None:
    env = {**SLURM_2_NODES, "SLURM_NODEID": str(node_id)}
    node = slurm_node(env, hostnames=expand_nodelist)
    assert node == SlurmNode(
        nnodes=2,
        node_rank=node_id,
        rdzv_endpoint="gpu07:29500",
        rdzv_id="slurm-4242",
        hosts_rendezvous=node_id == 0,  # the endpoint is node 0's host: it hosts the store, say so
    )

    # Through the command line: `merak train job.yaml --slurm` on a job of dp*tp*pp = 2 ranks.
    args = _build_parser().parse_args(["train", "job.yaml", "training.max_steps=3", "--slurm"])
    _from_slurm(args, env)
    cmd = torchrun_command(args, world_size=2)
    flags = _flags(cmd[: cmd.index("merak_core.launch")])
    assert flags == {
        "nproc-per-node": "1",
        "max-restarts": "0",
        "nnodes": "2",
        "rdzv-backend": "c10d",
        "rdzv-endpoint": "gpu07:29500",
        "rdzv-id": "slurm-4242",
        "node-rank": str(node_id),
        "rdzv-conf": "is_host=true" if node_id == 0 else "is_host=false",
    }
    assert cmd[-2:] == ["job.yaml", "training.max_steps=3"]


def test_the_step_wins_over_the_job_and_the_port_comes_from_the_environment() -> None:
    # `srun --nodes=1` inside a 2-node allocation: one node in this step, the rendezvous on its host.
    env = {
        **SLURM_2_NODES,
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "gpu08",
        "MASTER_PORT": "31000",
    }
    assert slurm_node(env, hostnames=expand_nodelist) == SlurmNode(
        nnodes=1, node_rank=0, rdzv_endpoint="gpu08:31000", rdzv_id="slurm-4242", hosts_rendezvous=True
    )
    env["MERAK_RDZV_PORT"] = "32000"
    assert slurm_node(env, hostnames=expand_nodelist).rdzv_endpoint == "gpu08:32000"
    # SLURM_NNODES (older Slurm) and a given endpoint, which spares reading the host list; who hosts
    # a given endpoint is left to torchrun (no --rdzv-conf)
    old = {"SLURM_JOBID": "7", "SLURM_NNODES": "3", "SLURM_NODEID": "2"}
    assert slurm_node(old, rdzv_endpoint="head:29400") == SlurmNode(
        nnodes=3, node_rank=2, rdzv_endpoint="head:29400", rdzv_id="slurm-7", hosts_rendezvous=None
    )
    args = _build_parser().parse_args(["train", "job.yaml", "--slurm", "--rdzv-endpoint", "head:29400"])
    _from_slurm(args, old)
    assert not any(t.startswith("--rdzv-conf") for t in torchrun_command(args, world_size=3))


def test_expand_nodelist_reads_slurms_compressed_form() -> None:
    assert expand_nodelist("gpu[01-03,07],login5") == ["gpu01", "gpu02", "gpu03", "gpu07", "login5"]
    assert expand_nodelist("localhost,localhost") == ["localhost", "localhost"]
    assert expand_nodelist("n[8-10]-ib") == ["n8-ib", "n9-ib", "n10-ib"]
    for bad in ("a[1-2]b[3]", "a[x]", "a[3-1]", " "):
        with pytest.raises(ValueError, match="host list"):
            expand_nodelist(bad)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "2"},
            "SLURM_NODEID is not set: run 'merak train --slurm' through srun",
        ),
        ({**SLURM_2_NODES, "SLURM_NODEID": "2"}, r"SLURM_NODEID=2 is not below the 2 nodes"),
        ({**SLURM_2_NODES, "SLURM_NODEID": "x"}, r"SLURM_NODEID='x' is invalid: expected an integer >= 0"),
        (
            {**SLURM_2_NODES, "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu07"},
            r"SLURM_JOB_NODELIST='gpu07' names 1 hosts \(gpu07\), but the step has 2 nodes",
        ),
        (
            {**SLURM_2_NODES, "SLURM_NODEID": "0", "MASTER_PORT": "99999"},
            r"MASTER_PORT='99999' is not a port",
        ),
    ],
)
def test_a_missing_or_inconsistent_variable_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        slurm_node(env, hostnames=expand_nodelist)


def test_flags_that_contradict_slurm_are_refused() -> None:
    args = _build_parser().parse_args(["train", "job.yaml", "--slurm", "--node-rank", "0"])
    with pytest.raises(ValueError, match="--node-rank 0 contradicts Slurm's 1: drop --node-rank"):
        _from_slurm(args, {**SLURM_2_NODES, "SLURM_NODEID": "1"})
    args = _build_parser().parse_args(["train", "job.yaml", "--slurm", "--nnodes", "2", "--rdzv-id", "mine"])
    _from_slurm(args, {**SLURM_2_NODES, "SLURM_NODEID": "1"})  # the same values, and an id of one's own
    assert (args.nnodes, args.node_rank, args.rdzv_id) == (2, 1, "mine")


@pytest.mark.slow  # a subprocess (bash, no Python): milliseconds
@pytest.mark.one_process
def test_the_sbatch_script_runs_one_merak_train_slurm_per_node(tmp_path: Path) -> None:
    """``train.sbatch`` under a fake ``srun`` that prints what it was asked to run."""
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    srun.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        "MERAK": "python -m merak_core.cli",
    }
    script = REPO / "examples" / "slurm" / "train.sbatch"
    argv = ["job.yaml", "training.max_steps=3", "--resume", "auto"]
    out = subprocess.run(["bash", str(script), *argv], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == [
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "python",
        "-m",
        "merak_core.cli",
        "train",
        "--slurm",
        *argv,
    ]
    usage = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr
