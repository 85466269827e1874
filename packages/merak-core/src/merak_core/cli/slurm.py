"""``merak train --slurm``: one node's multi-node flags, read from Slurm's environment.

In a Slurm job, ``srun --ntasks-per-node=1 merak train --slurm JOB`` runs one ``merak train`` per
node (``examples/slurm/train.sbatch``). Each reads the variables srun sets and derives what
torchrun needs to start its node's ranks and meet the others:

- ``--nnodes``: ``SLURM_STEP_NUM_NODES`` (the nodes of this srun step), else
  ``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES``;
- ``--node-rank``: ``SLURM_NODEID`` (0 .. nnodes-1);
- ``--rdzv-endpoint``: the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``,
  ``SLURM_NODELIST``), expanded by ``scontrol show hostnames`` or, without ``scontrol``, by
  :func:`expand_nodelist`; the port is ``MERAK_RDZV_PORT``, else ``MASTER_PORT``, else 29500;
- ``--rdzv-id``: ``slurm-$SLURM_JOB_ID``, so two jobs on one head node never share a rendezvous.

:func:`slurm_node` is a pure function of the environment (and of the host-list expansion it is
given), so the derivation is tested without Slurm. A missing or inconsistent variable is a
``ValueError`` naming it (``merak train`` prints it as one line and exits 2, before torchrun).

Not done here: building torchrun's command line (``train.py``); processes per node (``merak
train`` divides dp*tp*pp by the node count, or ``--nproc-per-node``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["DEFAULT_PORT", "SlurmNode", "expand_nodelist", "slurm_hostnames", "slurm_node"]

DEFAULT_PORT = 29500
"""The rendezvous port when neither ``MERAK_RDZV_PORT`` nor ``MASTER_PORT`` is set (torchrun's default)."""

_HINT = "run 'merak train --slurm' through srun inside a Slurm allocation (see examples/slurm/README.md)"


@dataclass(frozen=True, kw_only=True)
class SlurmNode:
    """What one node of a Slurm job passes to torchrun."""

    nnodes: int
    """Nodes of the job step (torchrun ``--nnodes``)."""
    node_rank: int
    """This node's index, 0 .. nnodes-1 (torchrun ``--node-rank``)."""
    rdzv_endpoint: str
    """``host:port`` of the c10d rendezvous: the step's first node."""
    rdzv_id: str
    """``slurm-<job id>`` (torchrun ``--rdzv-id``)."""
    hosts_rendezvous: bool | None = None
    """Whether this node's torchrun hosts the rendezvous store (torchrun ``--rdzv-conf=is_host=``):
    True on node 0 and False elsewhere when the endpoint is the step's first host; None (torchrun
    guesses from the host name) for an endpoint given by hand ([Note: rendezvous host])."""

    def flags(self) -> list[str]:
        """The ``merak train`` flags of this node."""
        return [
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
        ]


def slurm_node(
    env: Mapping[str, str],
    *,
    hostnames: Callable[[str], list[str]] | None = None,
    rdzv_endpoint: str | None = None,
) -> SlurmNode:
    """The torchrun flags of the node whose Slurm environment is ``env``.

    ``hostnames`` expands a Slurm host list (default :func:`slurm_hostnames`: ``scontrol``, else
    :func:`expand_nodelist`); a given ``rdzv_endpoint`` (``--rdzv-endpoint``) is used as it is, and
    the host list is not read. ValueError naming the variable when one is missing or inconsistent.
    """
    nnodes = _int_var(env, ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"), minimum=1)
    node_rank = _int_var(env, ("SLURM_NODEID",), minimum=0)
    if node_rank >= nnodes:
        raise ValueError(
            f"SLURM_NODEID={node_rank} is not below the {nnodes} nodes of the job step: "
            "expected 0 .. nnodes-1; " + _HINT
        )
    job_id = _var(env, ("SLURM_JOB_ID", "SLURM_JOBID"))[1]
    # [Note: rendezvous host] torchrun's c10d rendezvous makes the agent whose host name matches the
    # endpoint's host the store's server, and another agent that also matches (two nodes faked on one
    # machine, or host names that resolve alike) falls back to a client once the port is taken: the
    # first agent to bind wins. If that is not node 0 and its node finishes first, node 0's agent
    # loses the store at exit and waits out its timeout. With the endpoint derived here, node 0 is
    # its host, so each node says so explicitly.
    hosts: bool | None = None
    if rdzv_endpoint is None:
        rdzv_endpoint = _first_host(env, nnodes, hostnames) + ":" + str(_port(env))
        hosts = node_rank == 0
    return SlurmNode(
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=f"slurm-{job_id}",
        hosts_rendezvous=hosts,
    )


def _first_host(env: Mapping[str, str], nnodes: int, hostnames: Callable[[str], list[str]] | None) -> str:
    """The step's first host, where the rendezvous is (one host per node checked)."""
    list_name, nodelist = _var(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    hosts = (hostnames or slurm_hostnames)(nodelist)
    if len(hosts) != nnodes:
        raise ValueError(
            f"{list_name}={nodelist!r} names {len(hosts)} hosts ({', '.join(hosts)}), but the step has "
            f"{nnodes} nodes: expected one host per node; " + _HINT
        )
    return hosts[0]


def _port(env: Mapping[str, str]) -> int:
    port_name, port = next(
        ((n, env[n]) for n in ("MERAK_RDZV_PORT", "MASTER_PORT") if env.get(n)),
        ("default", str(DEFAULT_PORT)),
    )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{port_name}={port!r} is not a port: expected an integer in 1..65535")
    return int(port)


def slurm_hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm host list: ``scontrol show hostnames`` when Slurm is installed, else :func:`expand_nodelist`."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            return out
    return expand_nodelist(nodelist)


def expand_nodelist(nodelist: str) -> list[str]:
    """``"gpu[01-03,07],login5"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07", "login5"]`` (zero padding kept).

    Slurm's compressed form with one bracket per name, as ``SLURM_JOB_NODELIST`` writes it; a
    plain comma-separated list passes through. ValueError for a form it does not read.
    """
    hosts = [host for item in _split_top_level(nodelist.strip()) for host in _expand_item(item, nodelist)]
    if not hosts:
        raise ValueError(f"host list {nodelist!r} names no host")
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """The comma-separated items of a host list, commas inside brackets kept (``a[1,3],b`` -> ``a[1,3]``, ``b``)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, nodelist: str) -> list[str]:
    """``gpu[01-02,7]`` -> ``gpu01 gpu02 gpu7``; a name without brackets is itself."""
    match = re.fullmatch(r"([^\[\]]*)(?:\[([^\[\]]+)\])?([^\[\]]*)", item)
    if match is None:
        raise ValueError(
            f"host list {nodelist!r}: cannot read {item!r} (one [N-M,...] range per name); "
            "install Slurm's scontrol or pass --rdzv-endpoint HOST:PORT"
        )
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return [item]
    hosts = []
    for part in ranges.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"host list {nodelist!r}: cannot read the range {part!r} (expected N or N-M)")
        hosts += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def _var(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str]:
    """The first of ``names`` set (non-empty) in ``env``, as (name, value)."""
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    raise ValueError(f"{' / '.join(names)} is not set: {_HINT}")


def _int_var(env: Mapping[str, str], names: tuple[str, ...], *, minimum: int) -> int:
    name, value = _var(env, names)
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(f"{name}={value!r} is invalid: expected an integer >= {minimum}; {_HINT}")
    return int(value)
