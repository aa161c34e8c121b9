"""Publishing: a set to a Hub repo, each file uploaded from the machine that made it (``upload``),
committed in batches by the client with the repo's manifest (``publish``), the last commit with the
model card and TENSOR_MAP.md (``card``, ``tensor_map``)."""
