//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, built into a
//! `tokenizers` tokenizer.
