"""Planning: from config, index, tokenizer files and shard headers, every output file and tensor
(type, shape, transform, sources, bytes, peak memory), checked before anything is written."""
