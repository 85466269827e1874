"""A run after its model is composed: start-up, the parallel step engine, evaluation, non-finite
handling, signals, stalls and watchdogs, the logging cadence, metrics and reporting (TensorBoard,
W&B), and the exit codes shared with the CLI.

May import every folder below it (parallel, config, data, checkpoint, generation, hf, lora, checks);
never the planner, ``autoplan``, the Trainer or the CLI.
"""
