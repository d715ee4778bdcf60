"""The step's inputs: checkpoint, tokenizer and prompts, hashed and checked before any work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rl_engine import envs
from rl_engine.artifacts import manifest
from rl_engine.errors import BadInput
from rl_engine.models import checkpoint, prompts
from rl_engine.models.config import Qwen3Config


@dataclass(frozen=True, slots=True)
class Inputs:
    model_root: Path
    prompt_file: Path | None
    config: Qwen3Config
    state: dict[str, torch.Tensor]
    prompts: list[list[int]]

    def files(self) -> dict[str, list[Path]]:
        folder = self.model_root
        model_files = [folder / "config.json", *checkpoint.weight_files(folder)]
        tok = [p for p in (folder / "tokenizer.json", folder / "tokenizer_config.json") if p.exists()]
        return {"checkpoint": model_files, "tokenizer": tok,
                "prompts": [self.prompt_file] if self.prompt_file else []}


def embedded_model() -> Path:
    """The tiny model generated from a fixed seed under the state folder (made once)."""
    from rl_engine.models.generate import init_model

    folder = envs.RLK_STATE_DIR / "models" / "tiny"
    if not (folder / "config.json").exists():
        init_model("tiny", folder, seed=0)
    return folder


def load(model_root: Path | None, prompt_file: Path | None, *, count: int,
         chat_template: bool = False, verify_with: Path | None = None) -> Inputs:
    root = Path(model_root) if model_root is not None else embedded_model()
    if not root.is_dir():
        raise BadInput(f"MODEL_ROOT {root} is not a folder; give a Qwen3 checkpoint folder or unset "
                       "it for the embedded tiny model")
    if prompt_file is not None and not Path(prompt_file).is_file():
        raise BadInput(f"PROMPT_DATA {prompt_file} does not exist; give a JSONL file of prompts")
    if verify_with is not None:
        problems = manifest.verify(verify_with)
        if problems:
            raise BadInput(f"input verification against {verify_with} failed: {problems[0]}")
    checkpoint.verify_folder(root)  # a folder with manifest.sha256 must still match it
    config = checkpoint.load_config(root)
    state = checkpoint.load_state(root)
    checkpoint.check_state(config, state, root)
    if prompt_file is None:
        ids = prompts.default_prompts(root, chat_template=chat_template)
    else:
        ids = prompts.load_prompts(Path(prompt_file), root, chat_template=chat_template)
    if len(ids) < count:
        raise BadInput(f"ROLLOUT_BATCH_SIZE={count} prompts asked for, {prompt_file or 'the default set'} "
                       f"has {len(ids)}")
    return Inputs(root, Path(prompt_file) if prompt_file else None, config, state, ids[:count])
