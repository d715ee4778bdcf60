"""Atomic files, run-directory layout, ids and provenance."""
