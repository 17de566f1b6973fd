"""Faults: the spot-notice node agent, the failure journal (and the Ray Train callback
that writes it), and the fault drills tests use."""
