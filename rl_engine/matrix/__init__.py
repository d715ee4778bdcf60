"""The ablation matrix: one `rlk run` per cell, each into a new attempt folder; the analyzer's
verdict per cell, the attribution of a broken parity to a module, Parquet tables and history.

  <matrix-root>/matrix.json                  the matrix id and when it was created
  <matrix-root>/<cell>/<attempt-id>/         an `rlk run` directory plus matrix-case.env, console.log
  <matrix-root>/matrix-report.json, cells.parquet, tokens.parquet
"""
