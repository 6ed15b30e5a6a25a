"""Real weights: transformers' checkpoints, SmolLM2 from GGUF, MiniLM from
safetensors."""
