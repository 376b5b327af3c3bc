"""Model definitions (Llama, Qwen3, Qwen3-MoE) and loading from Hugging Face-format directories."""
