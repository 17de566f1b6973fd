"""Strategies: everything that differs between data-parallel schemes, behind one seam
(`base.Strategy`). Importing this package imports nothing heavy."""
