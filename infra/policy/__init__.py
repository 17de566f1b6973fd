"""Raylift's Pulumi policy pack (rules in rules.py; the pack entry point is __main__.py)."""
