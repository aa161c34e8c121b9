"""The plan as ``k3lab plan`` prints it: files, totals, disk and memory forecasts."""

from __future__ import annotations

from k3lab.pipeline.planning.plan import Plan
from k3lab.util import human_bytes


def describe_plan(plan: Plan, jobs: int = 1, max_rows: int = 12) -> str:
    """The plan as the table `k3lab plan` prints: files, totals, disk and memory forecasts."""
    lines = [f"{'output file':<40} {'source shard':<36} {'tensors':>7} {'bytes':>12} {'memory':>10}  types"]
    n = len(plan.files)
    for i, f in enumerate(plan.files):
        if n > max_rows and max_rows // 2 <= i < n - max_rows // 2:
            if i == max_rows // 2:
                lines.append(f"{'...':<40} ({n - max_rows} more files)")
            continue
        types: dict[str, int] = {}
        for t in f.tensors:
            types[t.info.type.name] = types.get(t.info.type.name, 0) + 1
        lines.append(
            f"{f.filename:<40} {f.source_file:<36} {len(f.tensors):>7} {human_bytes(f.nbytes):>12} "
            f"{human_bytes(f.memory):>10}  " + ", ".join(f"{k}:{v}" for k, v in sorted(types.items()))
        )
    total = sum(f.nbytes for f in plan.files)
    src_total = sum(f.source_bytes for f in plan.files)
    largest = max(f.source_bytes for f in plan.files)
    peak = max(f.memory for f in plan.files)
    lines += [
        f"{n} output files (a llama.cpp split set), {plan.n_tensors} tensors, {human_bytes(total)} of tensor data "
        f"from {human_bytes(src_total)} of text source shards",
        f"disk: final {human_bytes(total)} plus headers; working space none beyond the files themselves "
        f"(each is written as .partial and renamed); streaming from the Hub adds up to {jobs} x 2 source shards "
        f"({human_bytes(2 * jobs * largest)}; on Dask, 2 per worker thread); publishing (--push-to) keeps at most {jobs} x 2 output files "
        f"({human_bytes(2 * jobs * max(f.nbytes for f in plan.files))}: one written, one uploading)",
        f"memory: at most {human_bytes(peak)} per converting process (peak RSS, file-backed pages included), "
        f"{human_bytes(jobs * peak)} for --jobs {jobs}",
    ]
    return "\n".join(lines)
