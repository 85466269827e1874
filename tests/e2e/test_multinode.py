"""``merak train`` over two torchrun "nodes" on loopback gives the losses of one 4-rank node.

The multi-node path is torch's own: each node runs ``merak train ... --nnodes 2
--node-rank i --rdzv-endpoint 127.0.0.1:PORT``, which starts torchrun with a c10d
rendezvous; the two agents meet at the endpoint, agree on global ranks 0-3 and
start 2 workers each (tensor parallelism inside a node, the pipeline across the two). The same
job also runs as one node of 4 processes
(``merak train`` with its single-node default). Both write ``metrics.jsonl``
(global rank 0); the per-step losses and the final evaluation loss must agree
to float64 round-off, and every step must be there.

A tiny job keeps it fast: the demo's model and task (examples/addition) with 2
layers, a 1x2x2 layout (dp x tp x pp), 4 steps. The job file and the factories are written into
the test's temporary directory; the three ``merak`` commands (the 4-rank node
and the two 2-rank nodes) run at the same time, each in its own process group,
and are killed if they outlive ``TIMEOUT_S``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
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


@pytest.mark.slow
def test_two_nodes_on_loopback_match_one_node(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB % {"steps": STEPS})
    (tmp_path / "factories.py").write_text(textwrap.dedent(FACTORIES % {"repo": str(REPO)}))
    endpoint = f"127.0.0.1:{_free_port()}"
    rdzv_id = f"merak-test-{uuid.uuid4().hex[:8]}"

    logs = {name: tmp_path / f"{name}.log" for name in ("one_node", "node0", "node1")}
    multi_flags = ("--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id)
    procs = {
        "one_node": _merak(job, tmp_path / "one_node", log=logs["one_node"]),
        "node0": _merak(job, tmp_path / "two_nodes", *multi_flags, "--node-rank", "0", log=logs["node0"]),
        "node1": _merak(job, tmp_path / "two_nodes", *multi_flags, "--node-rank", "1", log=logs["node1"]),
    }
    _wait(procs, logs)

    # Each node started 2 workers that joined one 4-rank world through the c10d rendezvous.
    for name in ("node0", "node1"):
        text = logs[name].read_text()
        assert "--nproc-per-node=2" in text and "--nnodes=2" in text and "--rdzv-backend=c10d" in text, text[
            -2000:
        ]
    summary = json.loads((tmp_path / "two_nodes" / "summary.json").read_text())
    assert summary["steps"] == STEPS and "/4 dp=1 tp=2 pp=2" in summary["layout"], summary

    one_losses, one_eval = _metrics(tmp_path / "one_node")
    two_losses, two_eval = _metrics(tmp_path / "two_nodes")
    assert two_losses == pytest.approx(one_losses, rel=1e-12, abs=0.0)
    assert two_eval["eval_loss"] == pytest.approx(one_eval["eval_loss"], rel=1e-12, abs=0.0)
    assert two_eval["eval_accuracy"] == one_eval["eval_accuracy"]
    assert len(set(one_losses)) == STEPS, f"the loss did not change between steps: {one_losses}"
