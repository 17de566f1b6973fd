"""Watching a run: logs, the metrics file and MFU, per-worker memory and step phases,
experiment trackers."""
