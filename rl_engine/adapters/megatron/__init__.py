"""Megatron-core as the trainer: a layer spec routing each module's training side per the run's
plan (spec.py), a GPTModel of a Hugging Face Qwen3 folder (model.py, weights.py) and the resident
trainer rank behind the engine interface (rank.py)."""
