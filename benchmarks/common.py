"""What every benchmark shares: the row registry, timing helpers, the full-scale checkpoint and
its densified shard, the machine a table was measured on."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3lab.pipeline.state import OutputFolder

ROWS: dict[str, Callable[[], list[tuple[str, str, str]]]] = {}

CONVERT_ONE = """
import resource, sys, time
from k3lab.pipeline.running.start import start_run
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import SourceSpec
from k3lab.pipeline.writing.convert import convert_file
src, out, nohash = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if nohash:  # measure the manifest's cost: the same run with a hasher that does nothing
    import k3lab.formats.hashing
    class Null:
        def update(self, b): pass
        def hexdigest(self): return "0" * 64
    k3lab.formats.hashing.sha256 = Null
from k3lab.kimi_k3.model import MODEL
from k3lab.pipeline.planning.split import make_split
from k3lab.pipeline.running.start import RunOptions
spec = SourceSpec.local(src)
with start_run(MODEL, spec, out, RunOptions(split=make_split(None, 1))) as (plan, _, _):  # a layer per file
    source = open_source(spec)
import numpy as np
from k3lab.formats import mxfp4
mxfp4.repack(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint8))  # numba's one-time start (~1 s a process)
t = time.perf_counter()
convert_file(plan, 2, source, out, force=True)
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

FULL_TASK_SETUP = """
import sys, time
t0 = time.perf_counter()
from k3lab.pipeline.writing.convert import PlannedInputs, file_kvs
from k3lab.pipeline.state import OutputFolder
from k3lab.pipeline.sources import open_source
from k3lab.pipeline.sources.base import SourceSpec
out, src, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
t1 = time.perf_counter()
folder = OutputFolder(out)
from k3lab.kimi_k3.model import MODEL
plan = folder.plans.require(MODEL)
source = open_source(SourceSpec.local(src))
PlannedInputs(source, plan.file(k)).first()  # its first source file, its header checked
kvs = file_kvs(plan, k, folder)
t2 = time.perf_counter()
print(t1 - t0, t2 - t1)
"""

ROUNDS = 3

LAYER_ROUNDS = 7  # a few seconds a pair, and the pairs scatter most: more of them for the median

NOTEBOOK_01_PICKER = """
import sys, time
from k3lab import explore
src, out = sys.argv[1], sys.argv[2]
t = time.perf_counter()
plan, source = explore.open_conversion(src, src, out)
by = explore.planned_by_source(plan)
explore.shard_rows(plan, source, 1, by)  # the first pick also reads the index once
setup = time.perf_counter() - t
picks = []
for k in (2, 50, 94, 96, 7):
    t = time.perf_counter()
    explore.html_table(explore.shard_rows(plan, source, k, by))
    picks.append(time.perf_counter() - t)
print(setup, max(picks))
"""


def row(fn: Callable[[], list[tuple[str, str, str]]]) -> Callable[[], list[tuple[str, str, str]]]:
    ROWS[fn.__name__.removeprefix("bench_")] = fn
    return fn


def best_of(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _timed(cmd: list[str]) -> float:
    import subprocess

    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t


@dataclass(frozen=True)
class DiskRun:
    """One command's wall time, the disk's busy share over it and the CPU its processes used."""

    seconds: float
    busy: float  # the device's io_ticks over the wall time (1.0: a request in flight all along)
    read_gb: float
    written_gb: float
    cpu: float  # user + system seconds of the command's processes


def _device_of(path: Path) -> str | None:
    """The block device (its name in /proc/diskstats) holding ``path``, None where it cannot be told."""
    st = os.stat(path)
    try:
        return Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve().name
    except OSError:
        return None


def _diskstats(device: str | None) -> tuple[int, int, int]:
    """Bytes read, bytes written and milliseconds busy of ``device`` so far (zeros where unknown)."""
    if device:
        with contextlib.suppress(OSError), open("/proc/diskstats") as fh:
            for line in fh:
                f = line.split()
                if f[2] == device:
                    return int(f[5]) * 512, int(f[9]) * 512, int(f[12])
    return 0, 0, 0


def timed_on_disk(cmds: list[list[str]], where: Path) -> DiskRun:
    """Run ``cmds`` at once (each a process of its own), until all have ended: the wall time, and what
    the disk holding ``where`` and the processes did meanwhile."""
    import resource
    import subprocess

    device = _device_of(where)
    before, used = _diskstats(device), resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    procs = [subprocess.Popen(cmd) for cmd in cmds]
    codes = [proc.wait() for proc in procs]
    seconds = time.perf_counter() - t
    after, done = _diskstats(device), resource.getrusage(resource.RUSAGE_CHILDREN)
    if any(codes):
        raise subprocess.CalledProcessError(max(codes), cmds[codes.index(max(codes))])
    return DiskRun(
        seconds=seconds,
        busy=(after[2] - before[2]) / 1e3 / seconds,
        read_gb=(after[0] - before[0]) / 1e9,
        written_gb=(after[1] - before[1]) / 1e9,
        cpu=done.ru_utime + done.ru_stime - used.ru_utime - used.ru_stime,
    )


def _layer_row(experts: int) -> list[tuple[str, str, str]]:
    import subprocess
    import tempfile
    from pathlib import Path

    from k3lab.kimi_k3.synth import synthesize

    with tempfile.TemporaryDirectory(dir=".") as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        synthesize("layer", src, experts=experts)
        shard = next(
            src.glob("model-00002-of-*.safetensors")
        )  # (layer 1: five digits over six, as Moonshot names them)
        size = shard.stat().st_size
        runs = {"k3lab": [], "nohash": [], "cp": [], "cp+sync": [], "dd": []}
        rss = 0
        for _ in range(3):
            for key, flag in (("k3lab", "0"), ("nohash", "1")):
                os.sync()  # each run starts with no dirty pages left by the one before
                r = subprocess.run(
                    [sys.executable, "-c", CONVERT_ONE, str(src), str(out), flag],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                seconds, peak = r.stdout.split()
                runs[key].append(float(seconds))
                rss = max(rss, int(peak)) if key == "k3lab" else rss
            os.sync()
            runs["cp"].append(_timed(["cp", str(shard), str(Path(tmp) / "copy")]))
            os.sync()
            runs["cp+sync"].append(_timed(["sh", "-c", f"cp {shard} {tmp}/copy2 && sync {tmp}/copy2"]))
            os.sync()  # the disk's own speed, beside the ratios: a direct copy of the same file
            runs["dd"].append(_timed(["dd", f"if={shard}", f"of={tmp}/copy3", "bs=64M", "iflag=direct",
                                      "oflag=direct", "conv=fsync", "status=none"]))  # fmt: skip
        best = {k: min(v) for k, v in runs.items()}
    mb = size / 1e6
    return [
        (
            f"layer shard, {experts} experts ({mb:.0f} MB): convert + hash + fsync",
            f"{best['k3lab']:.2f} s",
            f"{mb / best['k3lab']:.0f} MB/s",
        ),
        ("  vs cp of the same file", f"{best['k3lab'] / best['cp']:.1f}x cp", f"cp {best['cp']:.2f} s"),
        (
            "  vs cp && sync",
            f"{best['k3lab'] / best['cp+sync']:.1f}x cp+sync",
            f"cp+sync {best['cp+sync']:.2f} s",
        ),
        (
            "  the disk: dd iflag=direct oflag=direct",
            f"{best['k3lab'] / best['dd']:.1f}x dd direct",
            f"dd direct {best['dd']:.2f} s ({size / best['dd'] / 1e9:.2f} GB/s copied)",
        ),
        (
            "  manifest hashing overhead",
            f"{100 * (best['k3lab'] / best['nohash'] - 1):+.0f}%",
            f"without hashing {best['nohash']:.2f} s",
        ),
        (
            "  peak RSS of the converting process",
            f"{rss / 2**20:.0f} MiB",
            "target <= 300 MiB, flat in experts",
        ),
    ]


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _fresh(out: Path) -> None:
    """No output file left, no dirty page, and (as root) an empty page cache: each timed run starts
    from the same state as its peer."""
    for f in Path(out).glob("*.gguf"):
        f.unlink()
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: the runs still alternate


def _dd_seconds(tmp: Path, size: int, *flags: str) -> float:
    """``dd`` of ``size`` bytes of zeros into a new file, fsynced (from the same fresh state as k3lab's runs)."""
    _fresh(tmp)
    target = tmp / "dd.out"
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={size // (16 << 20)}", "conv=fsync"]
    seconds = _timed([*cmd, *flags, "status=none"])
    target.unlink()
    return seconds


def _run_timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of a command, from /usr/bin/time."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("r") as tf:
        t = time.perf_counter()
        r = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", tf.name, *cmd],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        )
        seconds = time.perf_counter() - t
        return seconds, int(tf.read().split()[-1]) * 1024, r.stdout


def _full_checkpoint(tmp: Path) -> Path:
    import subprocess

    given = os.environ.get("K3LAB_FULL")
    if given:
        return Path(given)
    full = tmp / "full"
    subprocess.run(
        [sys.executable, "-m", "k3lab.cli", "synth", "--preset", "full", "--out", str(full)],
        check=True,
        capture_output=True,
    )
    return full


def sparse_set(full: Path, out: Path) -> Path:
    """The full model's GGUF split set as `convert` plans it, headers written and tensor data left as
    holes, with a MANIFEST.json (each tensor's SHA-256 that of its zeros): 1.42 TiB on paper, a few
    MB on disk; what a remote verify of the real set reads, byte for byte, at every offset."""
    import hashlib

    from gguf import GGUFWriter

    from k3lab import request
    from k3lab.formats.gguf_stream import ALIGNMENT
    from k3lab.pipeline.state.record import Record, TensorRecord, write_manifest
    from k3lab.pipeline.writing.convert import file_kvs

    plan = request.plan(request.Request(meta=str(full), out_dir=str(out)))
    folder = OutputFolder(out)
    zeros: dict[int, str] = {}

    def zero_sha(n: int) -> str:
        if n not in zeros:
            h, block = hashlib.sha256(), bytes(1 << 24)
            for k in range(0, n, len(block)):
                h.update(block[: min(len(block), n - k)])
            zeros[n] = h.hexdigest()
        return zeros[n]

    records = []
    for pf in plan.files:
        path = folder.output(pf.filename)
        w = GGUFWriter(path, plan.model.name)
        for kv in file_kvs(plan, pf.number, folder):
            if kv.key != "general.architecture":
                w.add_key_value(kv.key, kv.value, kv.type, sub_type=kv.sub_type)
        for t in pf.tensors:
            w.add_tensor_info(
                t.info.name, t.info.shape, np.dtype(np.float32), t.info.nbytes, raw_dtype=t.info.type
            )
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        pos = w.fout[0].tell()
        w.close()
        pos += -pos % ALIGNMENT
        start, tensors = pos, []
        for t in pf.tensors:
            pos += -pos % ALIGNMENT
            tensors.append(
                TensorRecord(
                    t.name, t.info.type.name, tuple(t.info.ne), t.nbytes, pos, zero_sha(t.nbytes), t.transform
                )
            )
            pos += t.nbytes
        pos += -pos % ALIGNMENT
        with open(path, "r+b") as fh:
            fh.truncate(pos)
            head = fh.read(start)
        records.append(
            Record(
                "text",
                pf.filename,
                pf.number,
                pos,
                start,
                hashlib.sha256(head).hexdigest(),
                tensors,
                len(plan.files),
                plan.n_tensors,
                pf.digest,
                plan.basename,
                plan.outtype,
                list(pf.sources),
            )
        )
    with open(folder.manifest, "wb") as fh:
        write_manifest(fh, records)
    return out


def _served(hub: object) -> dict[str, int]:
    out: dict[str, int] = {}
    for path, _, n in hub.served:  # type: ignore[attr-defined]
        out[path] = out.get(path, 0) + n
    return out


def _first8(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(8)


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fill_dense(full: Path, shard: str, dest: Path) -> Path:
    """A copy of ``full``'s checkpoint folder whose ``shard`` holds real bytes (random, 64 MiB
    repeated: a disk has no way to tell): the other shards are linked, not copied."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in full.iterdir():
        if f.name != shard and not (dest / f.name).exists():
            (dest / f.name).symlink_to(f.resolve())  # (absolute: a relative one would point beside itself)
    target = dest / shard
    size = (full / shard).stat().st_size
    if target.exists() and target.stat().st_size == size and target.stat().st_blocks * 512 >= size:
        return dest
    head = _first8(full / shard)
    n = 8 + int.from_bytes(head, "little")
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    with open(full / shard, "rb") as src, open(target, "wb") as fh:
        fh.write(src.read(n))
        left = size - n
        while left:
            k = min(left, len(block))
            fh.write(block[:k])
            left -= k
    return dest


def _six_layers(out: Path) -> Path:
    """A checkpoint of one dense and six MoE layers at the real expert dims, 16 experts each."""
    from k3lab.kimi_k3.synth import PRESETS, synthesize
    from k3lab.kimi_k3.synth.presets import layer_config

    if not (out / "config.json").exists():
        PRESETS["six-layers"] = functools.partial(layer_config, 7)
        synthesize("six-layers", out)
    return out


def _machine() -> str:
    """The commit, the date and the machine a table was measured on (printed above it)."""
    import platform
    import subprocess

    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True)
    return (
        f"commit {commit.stdout.strip() or '?'}{' (+ changes)' if dirty.stdout.strip() else ''}, "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, Python {platform.python_version()}"
    )
