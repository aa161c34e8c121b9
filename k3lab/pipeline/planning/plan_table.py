"""The plan as ``k3lab plan`` prints it: files, totals, disk and memory forecasts."""

from __future__ import annotations

from k3lab.pipeline.planning.plan import Plan
from k3lab.util import human_bytes


def streaming_disk(plan: Plan) -> int:
    """Source bytes on disk at once in a process streaming from the Hub: the files the tensor being
    converted reads, the one prefetched, and (when output files share a file) the one kept for the
    next task."""
    sizes = {s.file: s.size for s in plan.source_files}
    largest = max(sizes.values(), default=0)
    per_tensor = max(
        (sum(f.sources[i].size for i in t.files) for f in plan.files for t in f.tensors), default=0
    )
    shared = [s for s in sizes if len(plan.readers_of(s)) > 1]
    return per_tensor + largest + (max(sizes[s] for s in shared) if shared else 0)


def describe_sources(plan: Plan) -> str:
    """The checkpoint's layout as the plan found it, in words."""
    files = plan.source_files
    if len(files) == 1:
        return f"1 source file ({files[0].file})"
    spread = sum(len(plan.readers_of(s.file)) > 1 for s in files)
    per_output = max(len(f.sources) for f in plan.files)
    how = (
        f"{spread} of them hold tensors of two or more output files"
        if spread
        else f"each read by one output file (at most {per_output} per output file)"
    )
    return f"{len(files)} source files, {how}"


def describe_plan(plan: Plan, jobs: int = 1, max_rows: int = 12) -> str:
    """The plan as the table `k3lab plan` prints: files, totals, disk and memory forecasts."""
    lines = [f"{'output file':<40} {'source files':<40} {'tensors':>7} {'bytes':>12} {'memory':>10}  types"]
    n = len(plan.files)
    for i, f in enumerate(plan.files):
        if n > max_rows and max_rows // 2 <= i < n - max_rows // 2:
            if i == max_rows // 2:
                lines.append(f"{'...':<40} ({n - max_rows} more files)")
            continue
        types: dict[str, int] = {}
        for t in f.tensors:
            types[t.info.type.name] = types.get(t.info.type.name, 0) + 1
        names = f.source_names[0] + (f" (+{len(f.sources) - 1})" if len(f.sources) > 1 else "")
        lines.append(
            f"{f.filename:<40} {names:<40} {len(f.tensors):>7} {human_bytes(f.nbytes):>12} "
            f"{human_bytes(f.memory):>10}  " + ", ".join(f"{k}:{v}" for k, v in sorted(types.items()))
        )
    total = sum(f.nbytes for f in plan.files)
    src_total = sum(s.data_bytes for s in plan.source_files)
    peak = max(f.memory for f in plan.files)
    kind = "a llama.cpp split set" if plan.split_keys else "one GGUF file, no split keys"
    lines += [
        f"{n} output file{'s' if n > 1 else ''} ({kind}), {plan.n_tensors} tensors, {human_bytes(total)} of tensor "
        f"data, from {describe_sources(plan)} ({human_bytes(src_total)} of tensor data)",
        f"disk: final {human_bytes(total)} plus headers; working space none beyond the files themselves "
        f"(each is written as .partial and renamed); streaming from the Hub adds up to "
        f"{human_bytes(streaming_disk(plan))} of source files per process ({jobs} x: "
        f"{human_bytes(jobs * streaming_disk(plan))}; on Dask, per worker thread: the files the tensor "
        "converting reads, one prefetched, one kept for the next task); publishing (--push-to) keeps "
        f"at most {jobs} x 2 output files ({human_bytes(2 * jobs * max(f.nbytes for f in plan.files))}: "
        "one written, one uploading)",
        f"memory: at most {human_bytes(peak)} per converting process (peak RSS, file-backed pages included), "
        f"{human_bytes(jobs * peak)} for --jobs {jobs}; this command so far: {human_bytes(_peak_rss())} "
        "(making a plan holds the index's every name)",
    ]
    return "\n".join(lines)


def _peak_rss() -> int:
    """This process's peak RSS so far (Linux counts it in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
