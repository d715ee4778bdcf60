"""Loads a Hugging Face Qwen3 folder: config.json, weights (model.safetensors, or shards listed in
model.safetensors.index.json), tokenizer.json and tokenizer_config.json.

Every problem is reported before any weight is copied, naming the file and what to do about it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from rl_engine.models import hashing
from rl_engine.models.config import Qwen3Config
from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.tp import TPGroup
from rl_engine.runtime.routing import Router

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_HINT = "point MODEL_ROOT at a Qwen3 folder or create one with `rlk model init --preset tiny --out DIR`"
# Buffers some exporters store that carry no weights of their own.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def model_folder(folder: Path) -> Path:
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist or is not a folder; {_HINT}")
    return path


ARCHITECTURE, MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"


def check_kind(path: Path) -> None:
    """A Qwen3 config says so: `architectures` (when present) is exactly [Qwen3ForCausalLM] and
    `model_type` (when present) is qwen3, and at least one of them is present. Both are checked:
    a config of another model that names only its architecture is refused too."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: MODEL_ROOT must be a Qwen3 folder with "
                                f"config.json; {_HINT}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable JSON file ({e}); {_HINT}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds no JSON object; {_HINT}")
    arch, kind = data.get("architectures"), data.get("model_type")
    if arch is None and kind is None:
        raise ValueError(f"{path} names neither architectures nor model_type; a Qwen3 config has "
                         f"architectures [{ARCHITECTURE}] and model_type {MODEL_TYPE}")
    if arch is not None and arch != [ARCHITECTURE]:
        raise ValueError(f"{path}: architectures {arch!r} is not [{ARCHITECTURE!r}]; only Qwen3 "
                         f"causal LMs are supported; {_HINT}")
    if kind is not None and kind != MODEL_TYPE:
        raise ValueError(f"{path}: model_type {kind!r} is not {MODEL_TYPE!r}; only Qwen3 causal LMs "
                         f"are supported; {_HINT}")


def load_config(folder: Path) -> Qwen3Config:
    path = model_folder(folder) / "config.json"
    check_kind(path)
    try:
        return Qwen3Config.load(path.parent)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a usable Qwen3 config: {type(e).__name__}: {e}") from None


def expected_tensors(c: Qwen3Config) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Qwen3 tensor names and shapes of a config, in layer order."""
    h, d = c.hidden_size, c.head_dim
    shapes = [("model.embed_tokens.weight", (c.vocab_size, h))]
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes += [
            (pre + "input_layernorm.weight", (h,)),
            (pre + "self_attn.q_proj.weight", (c.num_attention_heads * d, h)),
            (pre + "self_attn.k_proj.weight", (c.num_key_value_heads * d, h)),
            (pre + "self_attn.v_proj.weight", (c.num_key_value_heads * d, h)),
            (pre + "self_attn.q_norm.weight", (d,)),
            (pre + "self_attn.k_norm.weight", (d,)),
            (pre + "self_attn.o_proj.weight", (h, c.num_attention_heads * d)),
            (pre + "post_attention_layernorm.weight", (h,)),
            (pre + "mlp.gate_proj.weight", (c.intermediate_size, h)),
            (pre + "mlp.up_proj.weight", (c.intermediate_size, h)),
            (pre + "mlp.down_proj.weight", (h, c.intermediate_size)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not c.tie_word_embeddings:
        shapes.append(("lm_head.weight", (c.vocab_size, h)))
    return shapes


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the folder: the shards its index lists, or the single file."""
    folder = model_folder(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index with a weight_map: "
                             f"{type(e).__name__}: {e}") from None
        paths = []
        for name in names:
            if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts:
                raise ValueError(f"{index} names shard {name!r} outside the model folder")
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder / name} is missing but {index} lists it; "
                                        "copy every shard of the checkpoint")
            paths.append(folder / name)
        return paths
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    raise FileNotFoundError(f"{folder} has neither {WEIGHTS} nor {INDEX}; {_HINT}")


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by its Hugging Face name."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path} cannot be read as safetensors ({e}); the file is damaged or "
                             "incomplete: download or generate the checkpoint again") from None
        repeated = sorted(part.keys() & state.keys())
        if repeated:
            raise ValueError(f"tensor {repeated[0]} appears in more than one shard (again in {path})")
        state.update(part)
    return state


def check_state(config: Qwen3Config, state: dict[str, torch.Tensor], where: Path) -> None:
    """Raises ValueError naming missing, misshapen or unknown tensors."""
    expected = dict(expected_tensors(config))
    missing = [n for n in expected if n not in state]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{where} lacks tensor(s) {', '.join(missing[:5])}{more} that config.json "
                         "implies; the weights do not match the config or the checkpoint is partial")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{where}: tensor {name} has shape {tuple(state[name].shape)} but "
                             f"config.json implies {shape}")
        if not state[name].is_floating_point():
            raise ValueError(f"{where}: tensor {name} has dtype {state[name].dtype}, not floating point")
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unknown = sorted(n for n in state.keys() - expected.keys() - tied
                     if not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        raise ValueError(f"{where} has tensor(s) this Qwen3 does not use: {', '.join(unknown[:5])}; "
                         "it is another architecture or variant (biases, MoE, ...)")


def build_model(folder: Path, router: Router, tp: TPGroup = TPGroup(), *,
                dtype: str | None = None) -> Qwen3:
    """This TP rank's Qwen3 shard with the folder's weights; dtype overrides config.torch_dtype."""
    config = load_config(folder)
    if dtype is not None:
        config = dataclasses.replace(config, torch_dtype=dtype)
    state = load_state(folder)
    check_state(config, state, Path(folder))
    model = Qwen3(config, router, tp)
    model.load_full(state)
    return model


def load_tokenizer(folder: Path, vocab_size: int | None = None) -> Tokenizer:
    """The folder's tokenizer.json; refused when it has ids the model's vocab does not (by
    default vocab_size comes from config.json)."""
    path = model_folder(folder) / TOKENIZER
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; the model folder needs a tokenizer.json "
                                "(the tokenizers library format that Hugging Face fast tokenizers save)")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises bare Exception for a bad file
        raise ValueError(f"{path} cannot be read by the tokenizers library: {e}") from None
    vocab = load_config(folder).vocab_size if vocab_size is None else vocab_size
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab:
        raise ValueError(f"{path} has token ids up to {top} but the model's vocab_size is {vocab}: "
                         "the tokenizer belongs to a different model")
    return tok


def load_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json as a dict ({} when the folder has none)."""
    path = model_folder(folder) / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def verify_folder(folder: Path) -> dict[str, str]:
    """{file: sha256} of the folder, checked against its manifest.sha256 when it has one (a
    Hugging Face download has none; its hashes are then only recorded)."""
    folder = model_folder(folder)
    if (folder / hashing.MANIFEST).is_file():
        return hashing.verify_manifest(folder / hashing.MANIFEST)
    return hashing.hash_folder(folder)
