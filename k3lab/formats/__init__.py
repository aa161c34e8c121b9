"""File formats and their codecs: GGUF streaming, safetensors, the manifest record, hashing, MXFP4, BPE merges. Nothing here knows Kimi-K3."""
