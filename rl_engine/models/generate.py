"""The generated preset models: random Qwen3 weights from a fixed seed and a byte-level BPE
tokenizer trained on a built-in corpus, written as a Hugging Face Qwen3 folder.

The same preset and seed give the same bytes in every file, so a manifest of the folder is a
stable identity for the model that a parity run used.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from rl_engine.models import hashing
from rl_engine.models.checkpoint import expected_tensors
from rl_engine.models.config import PRESETS, Qwen3Config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
MATRIX_STD = 0.02
# The LM head (and the embedding when the two are tied) is scaled so that logits have a standard
# deviation of about LOGIT_STD: log-probs of sampled tokens then spread over several nats instead
# of all sitting near -log(vocab).
LOGIT_STD = 2.0
NORM_NOISE = 0.1
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_TEXT = """\
The river ran past the old mill, and the miller counted the sacks of grain twice before dark.
A small robot learned to sort coloured blocks: red ones to the left, blue ones to the right.
Question: what is the capital of France? Answer: Paris is the capital of France.
Write a short poem about the sea. The sea is grey in winter and green in the summer light.
To solve an equation, do the same thing to both sides until the unknown stands alone.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
The training step computes log probabilities of sampled tokens and compares them bit for bit.
Every kernel adds its numbers in one fixed order, so the result does not depend on the batch.
Explain why the sky is blue. Sunlight scatters off the air, and blue light scatters the most.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
She opened the window, listened to the rain, and wrote the first line of a long letter home.
If a train leaves at noon and travels sixty miles an hour, how far has it gone by three o'clock?
Translate to French: good morning, thank you, see you tomorrow. Bonjour, merci, a demain.
List three prime numbers greater than ten: eleven, thirteen and seventeen.
The reward model prefers answers that are correct, short, and polite to the user.
{"name": "tiny", "layers": 4, "heads": [8, 4], "dtype": "bfloat16"}
"""


def corpus() -> list[str]:
    """The fixed training text: prose, code and arithmetic, so numbers and words get merges."""
    lines = _TEXT.splitlines()
    lines += [f"{a} + {b} = {a + b}. {a} times {b} is {a * b}."
              for a in range(40) for b in range(0, 40, 3)]
    return lines


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE of at most vocab_size ids: any text encodes, none maps to an unknown id."""
    floor = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer; "
                         f"use at least {floor}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def random_weights(config: Qwen3Config, seed: int) -> dict[str, torch.Tensor]:
    """Weights drawn in fp32 from one seeded generator, then rounded once to the config dtype."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_tensors(config):
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if len(shape) == 1:
            x = 1.0 + NORM_NOISE * x
        elif name == "lm_head.weight" or (config.tie_word_embeddings and "embed" in name):
            x = x * (LOGIT_STD / config.hidden_size ** 0.5)
        else:
            x = x * MATRIX_STD
        state[name] = x.to(config.dtype).contiguous()
    return state


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def write_folder(folder: Path, config: Qwen3Config, seed: int) -> None:
    tok = build_tokenizer(config.vocab_size)
    eos = tok.token_to_id(EOS_TOKEN)
    _write_json(folder / "config.json", {**config.to_hf(), "bos_token_id": None, "eos_token_id": eos})
    save_file(random_weights(config, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "bos_token": None,
        "model_max_length": config.max_position_embeddings, "clean_up_tokenization_spaces": False,
    })
    hashing.write_manifest(folder)


def init_model(preset: str | Qwen3Config, out_dir: Path, seed: int = 0) -> Path:
    """Writes the preset (or an explicit config) generated from seed into out_dir; the folder
    appears whole or not at all. Refuses an out_dir that exists and is not an empty folder."""
    if isinstance(preset, Qwen3Config):
        config = preset
    elif preset in PRESETS:
        config = PRESETS[preset]
    else:
        raise ValueError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
    if seed < 0:
        raise ValueError(f"seed={seed} must be >= 0")
    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty folder; "
                              "choose a new --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        write_folder(tmp, config, seed)
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # an empty out is replaced; a non-empty one makes this fail
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
