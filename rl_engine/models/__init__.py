"""Qwen3 dense, built only from routed ops; checkpoint and tokenizer loading."""
