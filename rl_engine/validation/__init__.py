"""Bitwise validation of a run directory's evidence."""
