"""Prompt files: JSONL, one object a line with `prompt` (text, tokenized as is) or
`prompt_token_ids` (used as given). With the chat template, a text prompt becomes the user turn of
the tokenizer_config.json template, rendered the way Hugging Face renders it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from rl_engine.artifacts import files
from rl_engine.models import checkpoint

# The embedded default workload: short, varied prompts that the generated tokenizer covers.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Question: what is 12 + 7? Answer:",
    "Write a short poem about the sea.",
    "def add(a, b):",
    "Explain why the sky is blue.",
    "List three prime numbers greater than ten:",
    "Translate to French: good morning.",
    "The quick brown fox",
    "If a train leaves at noon and travels sixty miles an hour,",
)


@dataclass(frozen=True, slots=True)
class PromptRecord:
    line: int
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def _record(obj: object, line: int, where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) or 'prompt_token_ids'")
    if has_text:
        text = obj["prompt"]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        return PromptRecord(line=line, text=text)
    ids = obj["prompt_token_ids"]
    if (not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of token ids >= 0")
    return PromptRecord(line=line, token_ids=tuple(ids))


def read_jsonl(path: Path) -> list[PromptRecord]:
    """The prompt records of a JSONL file (blank lines skipped); a bad line raises ValueError
    naming path:line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    records = []
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            records.append(_record(obj, number, where))
    if not records:
        raise ValueError(f"prompt file {path} holds no prompts")
    return records


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...} objects.
    return value.get("content") if isinstance(value, dict) else value


def render_chat(template: str, text: str, tokenizer_config: dict | None = None) -> str:
    """The user turn `text` through a Hugging Face chat template, with the generation prompt."""
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    specials = {k: _token_text(v) for k, v in (tokenizer_config or {}).items()
                if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": text}], add_generation_prompt=True, **specials)
    except TemplateError as e:
        raise ValueError(f"the chat template cannot render a user prompt: {e}") from None


def encode(records: list[PromptRecord], tokenizer: Tokenizer, *, vocab_size: int,
           chat_template: str | None = None, source: str = "prompts",
           tokenizer_config: dict | None = None) -> list[list[int]]:
    """Token ids of each record; text through the chat template when one is given."""
    out = []
    for rec in records:
        where = f"{source}:{rec.line}"
        if rec.token_ids is not None:
            if chat_template is not None:
                raise ValueError(f"{where}: a chat template applies to 'prompt' text only; give "
                                 "text or drop --chat-template")
            ids = list(rec.token_ids)
        else:
            text = rec.text if chat_template is None else render_chat(chat_template, rec.text,
                                                                       tokenizer_config)
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if not ids:
                raise ValueError(f"{where}: the prompt tokenizes to no tokens")
        if max(ids) >= vocab_size:
            raise ValueError(f"{where}: token id {max(ids)} is outside the model's vocab of "
                             f"{vocab_size}")
        out.append(ids)
    return out


def _model_template(folder: Path, chat_template: bool) -> tuple[dict, str | None]:
    config = checkpoint.load_tokenizer_config(folder)
    if not chat_template:
        return config, None
    template = config.get("chat_template")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{Path(folder) / checkpoint.TOKENIZER_CONFIG} has no chat_template; "
                         "drop --chat-template or use a model with a template")
    return config, template


def load_prompts(path: Path, model_folder: Path, *, chat_template: bool = False) -> list[list[int]]:
    """Token ids of every prompt of a JSONL file under the model folder's tokenizer."""
    records = read_jsonl(path)
    vocab = checkpoint.load_config(model_folder).vocab_size
    tokenizer = checkpoint.load_tokenizer(model_folder, vocab)
    config, template = _model_template(model_folder, chat_template)
    return encode(records, tokenizer, vocab_size=vocab, chat_template=template, source=str(path),
                  tokenizer_config=config)


def default_prompts(model_folder: Path, *, chat_template: bool = False) -> list[list[int]]:
    """Token ids of DEFAULT_PROMPTS under the model folder's tokenizer."""
    vocab = checkpoint.load_config(model_folder).vocab_size
    tokenizer = checkpoint.load_tokenizer(model_folder, vocab)
    config, template = _model_template(model_folder, chat_template)
    records = [PromptRecord(line=i + 1, text=t) for i, t in enumerate(DEFAULT_PROMPTS)]
    return encode(records, tokenizer, vocab_size=vocab, chat_template=template,
                  source="default prompts", tokenizer_config=config)


def write_jsonl(path: Path, texts: tuple[str, ...] = DEFAULT_PROMPTS) -> Path:
    """A prompt file of text prompts (the embedded default's file, by default)."""
    return files.write_text(Path(path), "".join(json.dumps({"prompt": t}) + "\n" for t in texts))
