"""merak_core: automated 3D-parallel (data, tensor, pipeline) training for PyTorch.

``init(dp, tp, pp)`` builds the parallel layout, ``Trainer(model, args, dataset)``
trains an ordinary model with it. See the package README.
"""

from merak_core.compose import ParallelModel, build_parallel_model, gather_full_state_dict
from merak_core.config import TrainingArguments, build_lr_scheduler
from merak_core.data import StageAwareDataLoader, StageBatch
from merak_core.layout import ParallelLayout, init
from merak_core.trainer import Trainer, default_loss

__version__ = "0.1.0"

__all__ = [
    "ParallelLayout",
    "ParallelModel",
    "StageAwareDataLoader",
    "StageBatch",
    "Trainer",
    "TrainingArguments",
    "__version__",
    "build_lr_scheduler",
    "build_parallel_model",
    "default_loss",
    "gather_full_state_dict",
    "init",
]
