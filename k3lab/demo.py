"""`k3lab demo`: the main job, end to end, on the built-in tiny synthetic model.

Synthesise the checkpoint, convert it, write the standalone tokenizer GGUF and the vision mmproj,
merge the manifest, verify every byte; and where llama.cpp is installed, compute the set's importance
matrix a layer at a time, make the IQ2_XXS variant with it and check it, and chat with the set
through its own chat template.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path
from typing import Any

from k3lab import request
from k3lab.errors import K3LabError
from k3lab.kimi_k3.synth.report import describe
from k3lab.pipeline.writing.single import beside_names
from k3lab.request import Request
from k3lab.util import human_bytes

CHAT = [{"role": "user", "content": "Hello! Who are you?"}]


def _chat(first_file: Path, n: int = 12) -> tuple[str, str]:
    """One chat turn with the set as llama.cpp runs it: llama-cpp-python's chat completion renders the
    conversation with the chat template the set carries (``tokenizer.chat_template``, read from the
    GGUF: nothing passed here), and llama.cpp generates the reply greedily. (The demo's weights are
    random: the reply is words drawn from the vocabulary, not an answer.)"""
    import llama_cpp

    llm = llama_cpp.Llama(str(first_file), n_ctx=512, n_threads=2, verbose=False)
    if (
        llm.chat_format != "chat_template.default"
    ):  # (the set's own template, not a format of llama-cpp-python's)
        raise K3LabError(f"{first_file.name}: llama-cpp-python did not take the set's chat template")
    answer = llm.create_chat_completion(messages=CHAT, max_tokens=n, temperature=0.0, top_k=1)
    return CHAT[0]["content"], answer["choices"][0]["message"]["content"]


def run_demo(workdir: str | Path, seed: int = 0, jobs: int = 2, model: str = "kimi-k3") -> int:
    workdir = Path(workdir)
    src, out = workdir / "src", workdir / "out"
    t0 = time.perf_counter()
    steps: list[tuple[str, float, str]] = []

    def step(label: str, t: float, note: str) -> None:
        steps.append((label, time.perf_counter() - t, note))
        print(f"[{time.perf_counter() - t0:5.1f} s] {label}: {note}")

    req = Request(meta=str(src), out_dir=str(out), jobs=jobs, model=model)
    the_model = req.load_model()
    if the_model.guide is None:
        raise K3LabError(f"--model {model}: brings no demo checkpoint (its Guide)")
    t = time.perf_counter()
    made = the_model.guide.demo(src, seed)
    if hasattr(made, "n_shards"):
        print(describe(made))
    step("synthesise", t, f"a synthetic {the_model.default_basename} checkpoint in {src}")

    t = time.perf_counter()
    files = request.convert(req, say=lambda line: print(f"  {line}"))
    written = sum(not f.skipped for f in files)
    what = "one GGUF file" if len(files) == 1 else f"{len(files)} GGUF split files"
    step("convert", t, f"{what} ({written} written, {len(files) - written} already complete)")
    beside = beside_names(the_model, the_model.default_basename, the_model.load_config(src))
    if the_model.tokenizer_kvs is not None:
        t = time.perf_counter()
        tok = request.tokenizer(req, str(out / beside["tokenizer"]))
        step("tokenizer", t, f"{tok.name} ({human_bytes(tok.stat().st_size)})")
    seen = None
    if the_model.single is not None:
        t = time.perf_counter()
        mmproj = request.vision(req, str(out / beside[the_model.single.key]))
        step("vision", t, f"{mmproj.name} ({human_bytes(mmproj.stat().st_size)})")
        if the_model.guide is not None and the_model.guide.check_vision is not None:
            t = time.perf_counter()
            seen = request.check_vision(req, str(mmproj))
            verdict = "every stage agrees" if seen.ok else f"FAILED at {seen.failed[0]}"
            step("check-vision", t, f"{verdict}: {len(seen.stages)} stages, {seen.image.tokens} image tokens")

    t = time.perf_counter()
    report = request.verify(req).report
    step(
        "verify",
        t,
        ("OK" if report.ok else "FAILED") + f": {report.files} files, {report.tensors} tensors, "
        "every byte against MANIFEST.json, every tensor made again from the source",
    )
    for line in report.lines():
        print("  ", line)

    first = out / files[0].filename
    llama = importlib.util.find_spec("llama_cpp") is not None
    variant_ok = True
    if llama:
        variant_ok = _variant(req, out, step)
        t = time.perf_counter()
        said, reply = _chat(first)
        step("chat", t, "llama.cpp, through the set's own chat template (random weights: random words)")
        print(f"  user: {said}\n  assistant: {reply!r}")
    else:
        print(
            "imatrix, variant, chat: llama-cpp-python is not installed (llama.cpp's kernels and runtime: "
            "`make demo` builds it where a C and C++ compiler is), those steps skipped"
        )

    print(f"\n{'step':<12} {'seconds':>8}  result")
    for label, seconds, note in steps:
        print(f"{label:<12} {seconds:>8.2f}  {note[:90]}")
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s; everything is in {workdir}/")
    if importlib.util.find_spec("llama_cpp") is not None:
        print(f"  next: llama-server -m {first} --jinja   (docs/running.md: a chat with your set)")
        print(f"        k3lab check-logits --meta {src} --gguf {first}")
    else:
        print(f"  next: k3lab verify {out} --src {src}   (every tensor made again from the source)")
    print("        make lab   (or: k3lab lab; the notebooks read this demo's files)")
    return 0 if report.ok and variant_ok and (seen is None or seen.ok) else 1


VARIANT = "IQ2_XXS"  # a size people run of Kimi-K3 (2.06 bits a weight), one that needs an imatrix


def _variant(req: Request, out: Path, step: Any) -> bool:
    """The sizes people run: the set's importance matrix (k3lab's own calibration text, a layer at a
    time), a variant made with it (byte for byte llama-quantize's), its every byte checked."""
    from k3lab import imatrix
    from k3lab.variants import VariantRequest, quantize

    t = time.perf_counter()
    made = imatrix.compute(req, imatrix.command_values(chunk_size=128, chunks=8))
    got, total = imatrix.statistics(made.path).coverage.reached()
    step("imatrix", t, f"{made.path.name}: {made.chunks} chunks of {made.chunk_size} tokens of k3lab's own text, "
         f"a layer at a time ({got} of {total} experts reached)")  # fmt: skip
    t = time.perf_counter()
    results = quantize(req, VariantRequest(variants=VARIANT, imatrix=str(made.path)))
    size = sum(v.nbytes for r in results for v in r.variants)
    step("variant", t, f"{VARIANT} with it, {human_bytes(size)} in {out / VARIANT} (llama-quantize's bytes)")
    t = time.perf_counter()
    checked = request.verify(dataclasses.replace(req, out_dir=str(out / VARIANT), meta=None)).report
    step(
        "verify",
        t,
        ("OK" if checked.ok else "FAILED") + f": {VARIANT}, {checked.tensors} tensors, every byte",
    )
    return checked.ok


def demo_command(req: Any, args: Any) -> int:
    """`k3lab demo`."""
    return run_demo(args.workdir, seed=args.seed, jobs=args.jobs, model=req.model)
