"""Experiment trackers (MLflow, W&B, TensorBoard): rank 0 only, never in the step's way
(`trackers`). Importing this package imports nothing heavy."""
