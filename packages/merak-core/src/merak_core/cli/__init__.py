"""The ``merak`` command line.

``merak plan CONFIG.yaml --world-size N --memory-per-device 8GiB`` profiles the
job's model on this machine and prints the planner's ranked configurations
(:mod:`merak_core.planner`); ``--write-config`` writes the job with the best one.

``merak train CONFIG.yaml [section.key=value ...]`` starts the job through
torchrun (``torch.distributed.run``): one process per rank, single node by
default, the usual multi-node flags passed through (``--slurm`` derives them from
Slurm's variables, :mod:`merak_core.cli.slurm`). Merak has no launcher of
its own; each rank then runs :mod:`merak_core.launch`.

``merak plans`` lists the registered TP plans; ``merak check CONFIG.yaml`` compares
every module the job's TP plan shards with the unsharded module (:mod:`merak_core.checks.tp_check`).
``merak export CHECKPOINT --to-hf OUT`` writes a checkpoint as a Hugging Face folder (:mod:`merak_core.cli.export`).
``merak eval CONFIG.yaml --checkpoint latest`` evaluates a checkpoint (:mod:`merak_core.cli.eval_job`).

Only :mod:`merak_core.cli.main` (and the per-rank entry point) configures logging; the
libraries never touch the root logger.

Modules: ``main`` (the parser, logging, the dispatch), ``train`` (with ``slurm``), ``plan`` (with the cluster
flags and dry runs), ``check`` (``plans`` and ``check``), ``job_args`` (the job file and overrides every
command that runs one starts with); ``export`` lives in
:mod:`merak_core.cli.export` and ``eval`` in :mod:`merak_core.cli.eval_job`.

The top of the package: it may import every folder, ``merak_core.launch`` and the package itself;
nothing imports it but the ``merak`` entry point.
"""

from merak_core.cli.main import main

__all__ = ["main"]
