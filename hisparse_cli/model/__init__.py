"""Our own forward pass for Llama-family models (llama, mistral, qwen2, qwen3)."""
