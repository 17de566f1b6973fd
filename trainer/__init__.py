"""Raylift trainer: one config, one loop, every strategy, on Ray Train or torchrun."""

__version__ = "0.1.0"
