"""The run directory and everything written into it: its layout (`layout`, the only module that
knows file names), the records with their writers and readers (`records`), the bit comparison of
log-probs (`compare`), and the one `judge()` that gives a run its verdict (`judge`).

Nothing is imported here, so that reading the layout (the UI, the DAGs) loads no torch."""
