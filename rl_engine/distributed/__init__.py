"""Collectives with one fixed reduction order at every size, and the production (native) ones."""
