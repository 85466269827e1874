"""The rank grid and everything that shards or synchronises a model over it.

Owns the layout (degrees, coordinates, groups, devices), composing a user's model into this rank's
share (pipeline stages, virtual stages, TP plans, context and expert parallelism), data-parallel
gradient sync, ZeRO-1 and FSDP2-based ZeRO-2/3, global gradient clipping and the one place that
touches torch APIs that moved between versions (``_compat``). May import ``merak_core.lora`` and the
three libraries (merak-pipe, merak-graph, merak-tp); nothing else of merak-core.
"""
