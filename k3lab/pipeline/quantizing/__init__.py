"""Quantised variants of a finished lossless set, the stage after writing: ``llama_types`` and
``llama_mix`` (llama.cpp's choice of each tensor's type, as data and plain functions, fed with the whole
model's facts), ``recipes`` (publishers' mixes as llama-quantize flags), ``variant`` (a variant's plan),
``metadata`` (file 1's keys as llama-quantize writes them), ``imatrix_files`` (an imatrix, local or on the
Hub, read by ranges), ``start`` and ``run`` (``k3lab quantize``), ``quantize`` (one variant file, ggml's
kernels on every core) and ``check`` (a variant made again from its set)."""
