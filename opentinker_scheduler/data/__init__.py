"""Data the scheduler keeps for clients: uploaded datasets and task checkpoints."""
