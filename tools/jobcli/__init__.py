"""The pieces of `tools/submit.py`, one concern each: where the cluster is (cluster),
what runs and submissions exist (runs), size presets (presets) and the cluster check
(doctor)."""
