"""Training data on the ranks: the stage-aware loader, text datasets (``text/``), the per-batch
token-id checks and the dataset fingerprint a resume is compared with.

May import ``merak_core.parallel`` and ``merak_core.config``; nothing above them.
"""
