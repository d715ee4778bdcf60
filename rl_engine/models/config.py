"""Qwen3 model configuration, read from and written to a Hugging Face `config.json`.

Torch-free on import (torch is imported by `dtype` only): the CLI reads the presets to print its
help, and `rlk matrix run` checks a model folder's config before any cell starts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The dtypes a config may name, by their torch attribute.
_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    max_position_embeddings: int = 40960

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 8:
            raise ValueError(f"head_dim={self.head_dim} must be a multiple of 8")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype={self.torch_dtype!r}; use one of {', '.join(_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_dtype)

    def check_tp(self, tp: int) -> None:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) % tp:
                raise ValueError(f"TP={tp} does not divide {name}={getattr(self, name)}; "
                                 "choose a TP size that divides the heads and the FFN width")

    def to_hf(self) -> dict:
        body = dataclasses.asdict(self)
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "hidden_act": "silu", "attention_bias": False, **body}

    @classmethod
    def from_hf(cls, data: dict) -> Qwen3Config:
        if data.get("model_type") not in (None, "qwen3"):
            raise ValueError(f"model_type {data.get('model_type')!r} is not qwen3")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs.setdefault("head_dim", data["hidden_size"] // data["num_attention_heads"])
        # transformers 5 writes the RoPE settings as rope_parameters (older files: rope_theta and
        # rope_scaling); only plain RoPE is implemented, so scaled variants are refused.
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"RoPE scaling {rope!r} is not supported; only plain RoPE is")
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if data.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported; only full attention is")
        if isinstance(kwargs.get("torch_dtype"), str) is False:
            kwargs["torch_dtype"] = data.get("dtype", "bfloat16")
        return cls(**kwargs)

    @classmethod
    def load(cls, folder: Path) -> Qwen3Config:
        path = Path(folder) / "config.json"
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} is missing: MODEL_ROOT must be a Qwen3 folder with "
                                    "config.json (create one with `rlk model init --preset tiny`)") from None


PRESETS: dict[str, Qwen3Config] = {
    "tiny": Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "small": Qwen3Config(vocab_size=32768, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=64),
    # The GPU step benchmark's model: head_dim 128 as in Qwen3-4B/8B, four layers.
    "medium": Qwen3Config(vocab_size=51200, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128),
}
