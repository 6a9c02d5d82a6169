"""Tensor parallelism inside one worker: group.py (the ranks' process groups), layers.py (the sharded layers a
model is built from), step_sync.py (rank 0's step inputs to the others), runner.py (rank 0: the engine's
ModelRunner, which starts and feeds the others), follower.py (ranks 1..N-1)."""
