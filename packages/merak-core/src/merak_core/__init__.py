"""merak_core: automated 3D-parallel (data, tensor, pipeline) training for PyTorch.

``init(dp, tp, pp)`` builds the parallel layout, ``Trainer(model, args, dataset)``
trains an ordinary model with it. See the package README.
"""

from merak_core.checkpoint import CheckpointError, CheckpointManager
from merak_core.checkpoint.weights import export_full_state_dict, load_full_state_dict
from merak_core.config import TrainingArguments, build_lr_scheduler, parse_bytes, parse_recompute
from merak_core.data.loader import StageAwareDataLoader, StageBatch, split_inputs_labels
from merak_core.generation import generate
from merak_core.job import JobConfig
from merak_core.lora import LoraConfig
from merak_core.parallel.clip import clip_grad_norm_, global_grad_norm
from merak_core.parallel.compose import ParallelModel, build_parallel_model, gather_full_state_dict
from merak_core.parallel.data_parallel import DataParallelGradSync
from merak_core.parallel.layout import ParallelLayout, init
from merak_core.parallel.rank_grid import resolve_degrees
from merak_core.parallel.zero import ZeroOptimizer, partition_parameters
from merak_core.planner import Candidate, CommModel, ModelProfile, plan, profile_model
from merak_core.trainer import Trainer, default_loss

__version__ = "0.1.0"

__all__ = [
    "Candidate",
    "CommModel",
    "ModelProfile",
    "CheckpointError",
    "CheckpointManager",
    "DataParallelGradSync",
    "JobConfig",
    "LoraConfig",
    "ParallelLayout",
    "ParallelModel",
    "StageAwareDataLoader",
    "StageBatch",
    "Trainer",
    "TrainingArguments",
    "ZeroOptimizer",
    "__version__",
    "build_lr_scheduler",
    "build_parallel_model",
    "clip_grad_norm_",
    "default_loss",
    "export_full_state_dict",
    "generate",
    "gather_full_state_dict",
    "global_grad_norm",
    "init",
    "load_full_state_dict",
    "parse_bytes",
    "parse_recompute",
    "partition_parameters",
    "plan",
    "profile_model",
    "resolve_degrees",
    "split_inputs_labels",
]
