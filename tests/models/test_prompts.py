"""JSONL prompt files, their errors by line, and the chat template as Hugging Face renders it."""

from __future__ import annotations

import json

import pytest
import transformers

from rl_engine.models import checkpoint, prompts
from rl_engine.models.config import Qwen3Config
from rl_engine.models.generate import init_model

CONFIG = Qwen3Config(vocab_size=700, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return init_model(CONFIG, tmp_path_factory.mktemp("prompts") / "model")


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_text_and_token_id_prompts(folder, tmp_path):
    tok = checkpoint.load_tokenizer(folder)
    text = "What is 12 + 7? Answer: 19."
    path = write(tmp_path / "p.jsonl", [json.dumps({"prompt": text, "id": 1}), "",
                                        json.dumps({"prompt_token_ids": [5, 6, 699]})])
    ids = prompts.load_prompts(path, folder)
    assert ids == [tok.encode(text, add_special_tokens=False).ids, [5, 6, 699]]
    assert tok.decode(ids[0]) == text  # byte-level BPE: text comes back exactly


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a"', "not valid JSON"),
    ('["a"]', "expected a JSON object"),
    ('{"prompt": "a", "prompt_token_ids": [1]}', "exactly one of"),
    ('{"text": "a"}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt_token_ids": [1, true]}', "list of token ids"),
    ('{"prompt_token_ids": [1, 700]}', "token id 700 is outside the model's vocab of 700"),
])
def test_bad_line_is_named_by_number(folder, tmp_path, line, message):
    path = write(tmp_path / "p.jsonl", ['{"prompt": "fine"}', '{"prompt_token_ids": [1, 2]}', line])
    with pytest.raises(ValueError, match=f"p.jsonl:3: .*{message}"):
        prompts.load_prompts(path, folder)


def test_empty_or_missing_file(folder, tmp_path):
    with pytest.raises(ValueError, match="holds no prompts"):
        prompts.load_prompts(write(tmp_path / "empty.jsonl", ["", "  "]), folder)
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist"):
        prompts.load_prompts(tmp_path / "nope.jsonl", folder)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="latin1.jsonl:1: not UTF-8"):
        prompts.load_prompts(tmp_path / "latin1.jsonl", folder)


def test_chat_template_matches_hugging_face(folder, tmp_path):
    texts = ["What is 2 + 2?", "Write a short poem about the sea."]
    path = write(tmp_path / "p.jsonl", [json.dumps({"prompt": t}) for t in texts])
    ours = prompts.load_prompts(path, folder, chat_template=True)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for text, ids in zip(texts, ours):
        want = hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert ids == list(want)
    tok = checkpoint.load_tokenizer(folder)
    assert tok.decode(ours[0], skip_special_tokens=False) == \
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert ours[0][0] == tok.token_to_id("<|im_start|>")  # the marker is one special token


def test_chat_template_refuses_token_ids_and_missing_template(folder, tmp_path):
    path = write(tmp_path / "p.jsonl", [json.dumps({"prompt_token_ids": [1, 2]})])
    with pytest.raises(ValueError, match="p.jsonl:1: a chat template applies to 'prompt' text only"):
        prompts.load_prompts(path, folder, chat_template=True)
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (bare / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(ValueError, match="has no chat_template; drop --chat-template"):
        prompts.default_prompts(bare, chat_template=True)


def test_default_prompts_round_trip(folder, tmp_path):
    ids = prompts.default_prompts(folder)
    assert len(ids) == len(prompts.DEFAULT_PROMPTS) and all(ids)
    assert prompts.load_prompts(prompts.write_jsonl(tmp_path / "default.jsonl"), folder) == ids
