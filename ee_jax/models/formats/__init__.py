"""Checkpoint formats read (and written) as parameter trees: GGUF, Hugging Face folders,
Megatron (EE-LLM / EE-Tuning) checkpoints, ee-jax's own orbax checkpoints."""
