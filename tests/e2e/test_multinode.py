"""``merak train`` over two torchrun "nodes": the flags a user passes and the job they run.

The multi-node path is torch's own: each node runs ``merak train ... --nnodes 2 --node-rank i
--rdzv-endpoint HOST:PORT --rdzv-id ID``, which starts torchrun with a c10d rendezvous; the two
agents meet at the endpoint, agree on the global ranks and start their workers. ``merak train
--slurm`` derives the same four flags from Slurm's variables and builds the same torchrun command.
Here, in this process: the flags given by hand reach torchrun exactly as the ones ``--slurm``
derives for the same node. The real two-node job (two rendezvoused torchrun agents of 2 ranks each,
tensor parallelism inside a node and the pipeline across the two, losses equal to one node's) runs
once, started through ``--slurm``, in ``test_slurm_launch.py``; its job file, factories and helpers
are these.

A tiny job keeps it fast: the demo's model and task (examples/addition) with 2 layers, a 1x2x2
layout (dp x tp x pp), 4 steps. The ``merak`` commands run at the same time, each in its own
process group, and are killed if they outlive ``TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
STEPS = 4

JOB = """\
model: {factory: factories.py:build_model}
data: {factory: factories.py:build_datasets}
metrics: factories.py:exact_match
training:
  output_dir: out
  dp: 1
  tp: 2
  pp: 2
  dtype: float64
  per_device_train_batch_size: 4
  gradient_accumulation_steps: 2
  per_device_eval_batch_size: 4
  learning_rate: 3.0e-3
  warmup_steps: 1
  max_steps: %(steps)d
  logging_steps: 1
  seed: 0
  tp_plan:
    "layers.*.attn.query": column
    "layers.*.attn.key": column
    "layers.*.attn.value": column
    "layers.*.attn.out": row
    "layers.*.up": column
    "layers.*.down": row
"""

FACTORIES = """\
\"\"\"Factories of the two-node test's job: the demo's model and task, made tiny.\"\"\"
import sys

sys.path.insert(0, %(repo)r)

from examples.addition.data import build_datasets as _datasets, exact_match  # noqa: E402,F401
from examples.addition.model import build_model as _model  # noqa: E402


def build_model():
    return _model(depth=2, width=32, heads=4, vocab_size=13, context=16)


def build_datasets():
    return _datasets(train_size=256, eval_size=16, num_digits=2)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _python_path() -> str:
    """Where this process finds Merak, as absolute paths: the commands run in another directory."""
    import importlib

    roots = [
        str(Path(importlib.import_module(name).__file__).resolve().parents[1])  # type: ignore[arg-type]
        for name in ("merak_core", "merak_pipe", "merak_graph", "merak_tp")
    ]
    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(roots + inherited))


def _merak(job: Path, output_dir: Path, *flags: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=_python_path())
    cmd = [
        sys.executable,
        "-m",
        "merak_core.cli",
        "train",
        str(job),
        f"training.output_dir={output_dir}",
        *flags,
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=job.parent, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait(procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path]) -> None:
    failed = []
    for name, proc in procs.items():
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            failed.append((name, code))
    # Leftovers of a failed run, this test's own process groups only: SIGTERM first, so that each
    # torchrun agent stops its workers (they run in sessions of their own), then SIGKILL.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [proc for proc in procs.values() if proc.poll() is None]
        for proc in alive:
            os.killpg(proc.pid, sig)
        for proc in alive:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
    if failed:
        tails = "".join(
            f"\n--- {name} (exit {code}) ---\n" + logs[name].read_text()[-4000:] for name, code in failed
        )
        raise AssertionError(f"merak train failed or timed out after {TIMEOUT_S} s:{tails}")


def _metrics(output_dir: Path) -> tuple[list[float], dict[str, float]]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1)), records
    assert len(evals) == 1, records
    return losses, evals[0]


@pytest.mark.parametrize("node", [0, 1])
def test_flags_given_by_hand_reach_torchrun_as_the_slurm_derived_ones(node: int) -> None:
    from merak_core.cli.main import _build_parser
    from merak_core.cli.train import _from_slurm, torchrun_command

    hand = [
        "--nnodes",
        "2",
        "--node-rank",
        str(node),
        "--rdzv-endpoint",
        "127.0.0.1:29411",
        "--rdzv-id",
        "slurm-7",
    ]
    by_hand = _build_parser().parse_args(["train", "job.yaml", "training.max_steps=4", *hand])
    slurm = _build_parser().parse_args(["train", "job.yaml", "training.max_steps=4", "--slurm"])
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": str(node),
        "MERAK_RDZV_PORT": "29411",
    }
    _from_slurm(slurm, {**env, "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1"})
    command = torchrun_command(by_hand, world_size=4)
    # --slurm adds one flag of its own: which node's torchrun hosts the rendezvous store (node 0), so
    # that two agents on one host cannot both claim it (see [Note: rendezvous host] in cli/slurm.py).
    host_flag = f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}"
    derived = torchrun_command(slurm, world_size=4)
    assert host_flag in derived and host_flag not in command, derived
    derived.remove(host_flag)
    assert command == derived
    launcher = command[: command.index("merak_core.launch")]
    for flag in ("--nproc-per-node=2", "--nnodes=2", f"--node-rank={node}", "--rdzv-backend=c10d"):
        assert flag in launcher, launcher
    assert "--rdzv-endpoint=127.0.0.1:29411" in launcher and "--rdzv-id=slurm-7" in launcher, launcher
    assert command[-2:] == ["job.yaml", "training.max_steps=4"]
