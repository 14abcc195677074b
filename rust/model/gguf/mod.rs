//! GGUF model files (llama.cpp's format): the header, the metadata, the tensor table, and the
//! tensors themselves, memory-mapped and left in their stored (often quantized) block format.

pub mod tokenizer;
