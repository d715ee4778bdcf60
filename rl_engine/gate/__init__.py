"""The clean-room gate: `rlk gate STEP`, one command per step, each leaving `<gate-dir>/<step>.json`.

A pinned commit is checked out clean, built, its inputs verified, its targeted tests run, then the
R/R control (strict), the traced control and the P/P production run, the matrix, and an archive of
all of it. Every step that runs product code runs the checkout's code, in a subprocess started in
the checkout, so the gate harness and the code under test are never confused.
"""

STEPS: tuple[str, ...] = ("checkout", "build", "verify-inputs", "tests", "strict-run", "traced-run",
                          "production-run", "matrix", "archive")
# Steps that leave a run directory `<gate-dir>/<step>/` with a manifest.json.
RUN_STEPS: tuple[str, ...] = ("strict-run", "traced-run", "production-run")
