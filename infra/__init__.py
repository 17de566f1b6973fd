"""Raylift's Pulumi program (see infra/README.md). A package so tests can import its parts."""
