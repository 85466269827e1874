"""Text generation on the training layout: KV-cached decoding with TP-sharded caches and pipelined
microbatches (docs/generation.md).

Owns: the decoding loop (``decode``), its pipeline messages under pp (``pipeline``: merak-pipe's decode
schedule, interpreted), the eager forward each rank runs
(``decoders``: the TP-sharded model itself, or a pipeline stage's layers rebuilt on its parameters),
token choice (``sampling``). May import ``merak_core.parallel.compose`` (the composed model) and the three
libraries; never the Trainer.
"""

from merak_core.generation.decode import generate
from merak_core.generation.sampling import SamplingOptions

__all__ = ["SamplingOptions", "generate"]
