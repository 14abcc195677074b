"""Benchmark helpers: GGUF export and peer engines (optional `gguf`/`llama-cpp-python`)."""
