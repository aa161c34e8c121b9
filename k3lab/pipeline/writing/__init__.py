"""Writing: one output file converted and streamed to disk, its tensors' sources acquired as they are
needed (``convert``), and the files beside a set, the vision mmproj and the standalone tokenizer
GGUF (``single``). What a finished file holds is recorded by ``pipeline.state``."""
