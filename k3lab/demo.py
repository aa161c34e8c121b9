"""`k3lab demo`: the main job, end to end, on the built-in tiny synthetic model.

Synthesise the checkpoint, convert every text shard (in parallel), write the standalone
tokenizer GGUF and the vision mmproj, merge the manifest, verify every byte, and where
llama.cpp is installed, load the split set and generate a few tokens.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from k3lab.kimi_k3.model import MODEL
from k3lab.pipeline.checking.verify import verify
from k3lab.pipeline.running.runner import convert_shards
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.writing.single import convert_single, convert_tokenizer
from k3lab.synth import synthesize
from k3lab.synth.report import describe
from k3lab.util import human_bytes


def _generate(first_file: Path, n: int = 12) -> str:
    import llama_cpp

    llm = llama_cpp.Llama(str(first_file), n_ctx=128, n_threads=2, verbose=False)
    prompt = llm.tokenize(b"The quick brown fox", add_bos=False)
    llm.eval(prompt)
    out = []
    for _ in range(n):
        out.append(llm.sample(top_k=1, temp=0.0))
        llm.eval([out[-1]])
    return f"{prompt} -> {out}  ({llm.detokenize(out)!r})"


def run_demo(workdir: str | Path, seed: int = 0, jobs: int = 2) -> int:
    workdir = Path(workdir)
    src, out = workdir / "src", workdir / "out"
    t0 = time.perf_counter()
    steps: list[tuple[str, float, str]] = []

    def step(label: str, t: float, note: str) -> None:
        steps.append((label, time.perf_counter() - t, note))
        print(f"[{time.perf_counter() - t0:5.1f} s] {label}: {note}")

    t = time.perf_counter()
    result = synthesize("tiny", src, seed=seed)
    print(describe(result))
    step("synthesise", t, f"{result.n_shards} shards, {result.n_tensors} tensors in {src}")

    t = time.perf_counter()
    files = convert_shards(MODEL, SourceSpec.local(src), out, jobs=jobs)
    written = sum(not f.skipped for f in files)
    step(
        "convert",
        t,
        f"{len(files)} GGUF split files ({written} written, {len(files) - written} already complete)",
    )

    t = time.perf_counter()
    tok = convert_tokenizer(MODEL, src, out / "Kimi-K3-tokenizer.gguf")
    step("tokenizer", t, f"{tok.name} ({human_bytes(tok.stat().st_size)})")

    t = time.perf_counter()
    mmproj = convert_single(MODEL, SourceSpec.local(src), out / "mmproj-Kimi-K3-BF16.gguf")
    step("vision", t, f"{mmproj.name} ({human_bytes(mmproj.stat().st_size)})")

    t = time.perf_counter()
    report = verify(out, model=MODEL)
    step(
        "verify",
        t,
        ("OK" if report.ok else "FAILED") + f": {report.files} files, {report.tensors} tensors, "
        f"every byte against MANIFEST.json",
    )
    for line in report.problems:
        print("  ", line)

    if importlib.util.find_spec("llama_cpp") is not None:
        t = time.perf_counter()
        first = sorted(out.glob("Kimi-K3-*-00001-of-*.gguf"))[0]
        step("llama.cpp", t, "generated " + _generate(first))
    else:
        print("llama.cpp: llama-cpp-python not installed, generation skipped (`make test` installs it)")

    print(f"\n{'step':<12} {'seconds':>8}  result")
    for label, seconds, note in steps:
        print(f"{label:<12} {seconds:>8.2f}  {note[:90]}")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s; everything is in {workdir}/")
    print(f"  next: k3lab check-logits --meta {src} --gguf {sorted(out.glob('*-00001-of-*.gguf'))[0]}")
    print("        make lab   (or: k3lab lab; the notebooks read this demo's files)")
    return 0 if report.ok else 1
