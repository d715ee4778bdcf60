"""`rlk model ...`: create the generated preset models."""

from __future__ import annotations

from pathlib import Path

import typer

from rl_engine.models.config import PRESETS

app = typer.Typer(help="Model folders: generate the preset Qwen3 models.", add_completion=False,
                  no_args_is_help=True)


@app.callback()
def main() -> None:
    """Model folders: generate the preset Qwen3 models."""


@app.command()
def init(
    preset: str = typer.Option(..., "--preset", help=f"one of: {', '.join(PRESETS)}"),
    out: Path = typer.Option(..., "--out", help="new folder to write (must not exist, or be empty)"),
    seed: int = typer.Option(0, "--seed", help="seed of the weight generator"),
) -> None:
    """Write a preset Qwen3 model generated from a fixed seed, in Hugging Face format, with a
    byte-level BPE tokenizer and a manifest.sha256 of its files."""
    from rl_engine.models.generate import init_model  # torch and tokenizers load only when needed

    try:
        folder = init_model(preset, out, seed=seed)
    except (ValueError, FileExistsError, NotADirectoryError, PermissionError) as e:
        typer.echo(f"rlk model init: {e}", err=True)
        raise typer.Exit(2) from None
    except OSError as e:  # disk full, I/O error: the machine, not the request
        typer.echo(f"rlk model init: could not write {out}: {e}", err=True)
        raise typer.Exit(3) from None
    typer.echo(str(folder))
