"""Checkpoints: the manager (cadence, layout, manifests, stateful parts), staging copies
written in the background, and uploads."""
