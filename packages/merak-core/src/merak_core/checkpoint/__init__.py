"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, retained, reshardable across layouts.

::

    trainer.checkpoints.save()            # output_dir/checkpoints/step_<N>, every rank
    step = trainer.resume("latest")       # or a directory; any (dp, tp, pp) layout
    load_full_state_dict(trainer.checkpoint_parts, "model.safetensors")   # single-device weights (weights.py)
    export_full_state_dict("out/checkpoints/latest", "model.pt")

[Note: checkpoint keys] A checkpoint is a DCP directory whose keys do not depend
on the layout that wrote it, so any layout can read it:

- ``model/<logical name>``: the full logical parameter (see [Note: logical names]
  in compose.py), in the user's unsharded model's shape and orientation. A
  TP-sharded parameter is saved as a ``DTensor`` on the 1-D TP mesh with
  ``Shard(dim)`` (the dim of its ``merak_tp.ShardSpec``), so each TP rank writes only its block and DCP records
  the chunk offsets; replicated parameters are plain tensors. DP replicas and the
  copies of a parameter tied across stages write the same chunks, which DCP's
  planner deduplicates, so each chunk is stored once. A fused parameter
  (``ShardSpec.num_sections > 1``: its shard is several blocks of the full tensor) is
  gathered over TP and saved whole.
- ``optim/<logical name>/<state key>``: optimizer state (AdamW ``exp_avg``,
  ``exp_avg_sq``, ``step``). States shaped like the parameter are sharded like it;
  other tensors (the step count) are plain, non-tensors are pickled. Under ZeRO-1
  only the owning DP rank writes.
- ``train_state`` (pickled, written by rank 0): step, LR scheduler, optimizer
  hyper-parameters per group, data-loader position.
- ``rng/rank_<r>`` (pickled, per rank): every random stream of the rank (see
  [Note: random streams] in ``state.py``), restored under the same (dp, tp, pp) layout.

Next to the DCP files, ``merak_checkpoint.json`` holds the step, the layout, the
``TrainingArguments``, the model fingerprint (every logical name with its full
shape, checked before anything is read so a checkpoint of another model is
rejected with the differences named) and the manifest of checksums of every
file (see [Note: checkpoint manifest] in ``integrity.py``).

[Note: atomic commit] ``save`` first checks that every parameter and optimizer
state is finite (one all-reduce; see [Note: finite checkpoints]), then writes into
``step_<N>.tmp``; after every rank's DCP write has finished (DCP's final gather,
then a barrier) rank 0 writes the manifest, renames the directory to ``step_<N>``
and replaces the ``latest`` pointer with ``os.replace``. A crash at any point
leaves the previous committed checkpoint and pointer intact; a leftover ``.tmp``
is never loaded and is removed by the next save of that step.
``save_total_limit`` keeps the newest K committed checkpoints.

[Note: latest] ``latest`` (also ``auto``, a path ``.../checkpoints/latest``, or the
checkpoints directory itself) means the checkpoint the pointer names if its files
verify, else the next older committed one that does; each one skipped is logged as
a warning with the reason. Every API that takes a checkpoint path accepts it.

Every collective here runs on groups created with a timeout (the default group,
the layout's groups); barriers use ``monitored_barrier`` on gloo, which names the
rank that did not arrive.

The manager is handed the parts of a run explicitly (:class:`CheckpointParts`: arguments, layout,
model, optimizer, learning-rate schedule, data position, train state), never the loop that owns them.

Not done here: asynchronous saving.

May import ``merak_core.config``, ``merak_core.parallel`` and ``merak_core.lora`` (below it); never
``data``, ``hf``, ``run``, the planners or the Trainer: a run is handed over as its
:class:`~merak_core.checkpoint.parts.CheckpointParts` (saving, loading, weight import and export).
"""

from merak_core.checkpoint.files import (
    FORMAT,
    LATEST_FILE,
    META_FILE,
    CheckpointCorruptError,
    CheckpointError,
    dcp_metadata,
    describe_failure,
    is_corruption,
    latest_candidates,
    pointer_root,
    read_checkpoint_meta,
)
from merak_core.checkpoint.manager import CheckpointManager
from merak_core.checkpoint.parts import CheckpointParts, TrainState
from merak_core.checkpoint.save import NonFiniteCheckpointError
from merak_core.checkpoint.specs import TensorSpec, tensor_specs

_Spec = TensorSpec  # the earlier private name

__all__ = [
    "FORMAT",
    "LATEST_FILE",
    "META_FILE",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointParts",
    "NonFiniteCheckpointError",
    "TensorSpec",
    "TrainState",
    "dcp_metadata",
    "describe_failure",
    "is_corruption",
    "latest_candidates",
    "pointer_root",
    "read_checkpoint_meta",
    "tensor_specs",
]
