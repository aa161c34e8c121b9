"""k3lab benchmarks: `python benchmarks/run.py [ROW ...]` prints a table; each row is a module of
this package (its `bench_*` function), `common` what they share.

Every figure is a ratio against a peer measured in the same run (memcpy, `cp`, or the
straightforward implementation), because these machines are shared and noisy. Rows:
  repack      MXFP4 repack of one [3072, 3584] expert vs a numpy copy of the same bytes and vs
              the unpack/stack implementation
  layer       one `layer` shard (real expert dims 3584/3072) with 16 and 64 experts: conversion wall
              time (manifest hashing included) as a ratio to `cp` and to `cp && sync` of the same source
              file (k3lab fsyncs what it writes), hashing overhead, and peak RSS of the converting process
  fullscale   on `synth --preset full` (the real 96-shard headers; data as sparse holes, so reading costs
              no disk): planning once vs loading the saved plan, the fixed cost of a task before its
              first byte, re-running a complete shard, one MoE shard vs `dd conv=fsync` of the same
              size, --jobs 1 vs --jobs 2 on two MoE shards, and peak RSS per shard kind vs the plan's
              forecast. Needs ~40 GB free disk (output files are deleted as it goes); K3LAB_FULL=DIR
              reuses a synthesised full checkpoint.
  notebooks   on `synth --preset full`: notebook 01's shard picker (slowest change), notebook 02 run
              headless by papermill (wall time, peak RSS)
  startup     `k3lab --help` and `k3lab verify` of the tiny set (whole commands, best of 7), at this
              checkout and at K3LAB_BASELINE (a git ref, default the commit before "one way in"): what
              a command imports before it does anything; `convert`, `verify` and `plan` of the tiny
              model against `python -c pass`; and a planned real-size file's edges under strace: from
              the command's start to its first source read, from its last write to its exit
  remote      looking without downloading, at the real model's size (`synth --preset full` served by
              the loopback Hub in another process, one link paced at K3LAB_LINK bytes/s, default 200e6):
              notebook 02's view of one layer (bytes against the shard, time against bytes/rate),
              the same view again, notebook 01's planning (every shard's header, nothing else), and
              `verify ORG/NAME` of a sparse full-size GGUF set (headers, --sample 1, --all's memory)
  dense       one real-size MoE shard with real bytes (a `full` checkpoint's shard 2, its data filled
              with random bytes: 17 GB), each run from an empty page cache (as root: drop_caches;
              said when not): convert it, against a `dd iflag=direct oflag=direct` copy of the same
              file and two `dd`s at once (one reading it, one writing as many bytes: the floor of a
              converter that reads and writes together), rounds taking turns at going first; the
              disk's busy share and the CPU of k3lab's runs
  cluster     a real `dask scheduler` and one `dask worker` (then two) publishing 6 MoE layer shards at
              the real expert dims (16 experts each) from the loopback Hub to the loopback Hub, each
              worker's link paced both ways (K3LAB_LINK bytes/s down, K3LAB_UPLINK up; default 40e6
              each) so that the network sets the pace: wall time against the larger of a worker's
              download, upload and conversion times plus one shard's fill, beside the same run by
              K3LAB_BASELINE's code (one step after another)
  variants    a real-size MoE file (a `layer` checkpoint's layer 1, 16 experts at the real dims) by
              `k3lab quantize` and llama.cpp's own `llama-quantize`, whole set, same cores, paired: to
              Q2_K and to IQ2_XXS with an imatrix (bytes equal); then the whole model per variant
              (its size from the plan of the real headers, its time from each type's speed here)
  imatrix     a real-width MoE layer set's importance matrix by `k3lab imatrix` and llama.cpp's own
              `llama-imatrix`, same text and cores, paired at 12 chunks of 64 and 8 of 512 (every
              entry the same bits); then the real model's forecast: time per layer per 100 chunks,
              the whole model, memory per task (the graph built at the real shapes), state between layers
  fit         what `quantize --fit-ram` chooses for Kimi-K3 on 384 GB to 1 TB machines (with and without a
              24/80 GB GPU, 32,768 tokens of context): the plan of the real headers, the losses per
              weight measured on the widths set (its imatrix: tests/data), foretold per tensor; each
              mix's size, bits per weight of the experts and the rest, predicted loss
              (`python benchmarks/fit_table.py` prints docs/variants.md's table)
  fitproof    where llama.cpp runs the model: on the 0.40B's shape, Q2_K and the MoE-Q2_K recipe against
              `--fit` at each one's size, KL from the lossless set and the top token kept
              (`python benchmarks/fit_proof.py`)
  tokenizer   GGUF vocabulary of the real size (163,840 ids) vs the straightforward per-token BPE
              reconstruction (as upstream does it) on the same vocabulary; the merges must agree
"""
