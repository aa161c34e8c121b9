"""The stream engine's promises beyond its bytes: each stream asks for its next piece before it reads
the current one (so a real shard is read from disk while the current piece is repacked and
hashed), and a process that converts no MXFP4 tensor never imports numba."""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from conftest import PER_LAYER
from gguf import GGMLQuantizationType

from k3lab.formats import mxfp4
from k3lab.pipeline.streams import GENERIC, TensorJob

Src = namedtuple("Src", "name dtype shape nbytes")


class Recorder:
    """A reader of arrays in memory that logs every read and every read-ahead hint, in order."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays, self.log = arrays, []

    def __call__(self, name: str, row_start: int = 0, row_stop: int | None = None) -> np.ndarray:
        self.log.append(("read", name, row_start))
        return self.arrays[name][row_start:row_stop]

    def ahead(self, name: str, row_start: int = 0, row_stop: int | None = None) -> None:
        self.log.append(("ahead", name, row_start))


def _hinted_before_read(log: list[tuple[str, str, int]]) -> None:
    """Every read but the first was hinted before the previous piece was read."""
    reads = [(n, r) for op, n, r in log if op == "read"]
    for prev, cur in zip(reads, reads[1:]):
        hint = log.index(("ahead", *cur))
        assert hint < log.index(("read", *prev)), (cur, log)


def test_the_mxfp4_stream_hints_the_next_expert_and_gives_the_repack() -> None:
    rng = np.random.default_rng(3)
    arrays, sources = {}, []
    for e in range(4):
        arrays[f"e{e}.packed"] = rng.integers(0, 256, (8, 16), dtype=np.uint8)
        arrays[f"e{e}.scale"] = rng.integers(110, 130, (8, 1), dtype=np.uint8)
        sources += [Src(f"e{e}.packed", "U8", (8, 16), 128), Src(f"e{e}.scale", "U8", (8, 1), 8)]
    read = Recorder(arrays)
    job = TensorJob(
        GENERIC["mxfp4_stack"], sources, GGMLQuantizationType.MXFP4, (4, 8, 32), 4 * 8 * 17, None, read
    )
    out = [bytes(p) for p in job.pieces()]
    assert out == [mxfp4.repack(arrays[f"e{e}.packed"], arrays[f"e{e}.scale"]).tobytes() for e in range(4)]
    _hinted_before_read([x for x in read.log if ".packed" in x[1]])
    assert {n for op, n, _ in read.log if op == "ahead"} == {s.name for s in sources[2:]}


def test_the_rows_and_each_streams_hint_their_next_piece() -> None:
    big = np.arange(3 * (1 << 22), dtype=np.uint16).reshape(-1, 1 << 12)  # 24 MiB: two 16 MiB slabs
    read = Recorder({"w": big})
    src = Src("w", "BF16", big.shape, big.nbytes)
    job = TensorJob(GENERIC["copy"], [src], GGMLQuantizationType.BF16, big.shape, big.nbytes, None, read)
    assert b"".join(bytes(p) for p in job.pieces()) == big.tobytes()
    assert sum(op == "read" for op, _, _ in read.log) == 2
    _hinted_before_read(read.log)

    experts = {f"x{e}": np.full((4, 4), e, dtype=np.uint16) for e in range(3)}
    read = Recorder(experts)
    sources = [Src(n, "BF16", (4, 4), 32) for n in experts]
    job = TensorJob(GENERIC["stack"], sources, GGMLQuantizationType.BF16, (3, 4, 4), 96, None, read)
    assert b"".join(bytes(p) for p in job.pieces()) == np.stack(list(experts.values())).tobytes()
    _hinted_before_read(read.log)


def test_a_task_on_a_file_without_mxfp4_never_imports_numba(tiny_src: Path, tmp_path: Path) -> None:
    """numba costs ~70 MB and a few hundred ms a process: only the repack and the vocabulary (planning,
    file 1) load it. A task on a saved plan converting the output tensors never does."""
    from k3lab.cli import main

    assert main(["plan", "--meta", str(tiny_src), "--out-dir", str(tmp_path), *PER_LAYER]) == 0
    code = (
        "import sys; from k3lab.cli import main; "
        f"code = main(['convert', '--meta', {str(tiny_src)!r}, '--out-dir', {str(tmp_path)!r}, "
        "'--split-max-tensors', '1', '--shards', '9', '--quiet']); print(code, 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["0", "False"], out
    code_moe = code.replace("'--shards', '9'", "'--shards', '3'")  # a MoE layer: repacked, so loaded
    out = subprocess.run([sys.executable, "-c", code_moe], capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["0", "True"], out


def test_a_local_conversion_imports_no_hub_client_nor_ggml_and_leaves_without_teardown(
    tiny_src: Path, tmp_path: Path
) -> None:
    """A command's fixed cost: converting a local copy, unpublished and with no variant, imports neither
    the Hub's HTTP client (publishing's transport) nor quantising (ggml's binding); and the ``k3lab`` command then
    leaves at once (``entry.run``), its hashing thread ended rather than waited for by a teardown of
    the interpreter (0.17 s after a conversion). A witness object says whether the teardown ran."""
    code = f"""
import sys
class Witness:
    def __del__(self):
        print("torn down", flush=True)
witness = Witness()
sys.argv = ["k3lab", "convert", "--meta", {str(tiny_src)!r}, "--out-dir", {str(tmp_path)!r},
            "--split-max-tensors", "1", "--files", "3", "--quiet"]
import atexit
def loaded():
    ggml = sys.modules.get("k3lab.formats.ggml")  # (its types are plain data: the binding is what costs)
    binding = ["ggml()"] if ggml is not None and ggml.ggml.cache_info().currsize else []
    return binding + sorted(m for m in sys.modules if m.startswith(("k3lab.pipeline.quantizing.start",
        "k3lab.pipeline.quantizing.quantize", "k3lab.pipeline.hub.transport", "k3lab.pipeline.hub.xet",
        "huggingface_hub", "httpx", "llama_cpp")))
atexit.register(lambda: print(loaded(), flush=True))
from k3lab.entry import run
run()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]", r.stdout  # (the summary line comes first)
    assert "torn down" not in r.stdout, r.stdout


def test_a_run_asks_for_numbas_files_without_importing_it() -> None:
    """``warm_kernel`` (a run's start) brings llvmlite's library into the page cache, where loading
    the kernel from a cold cache would read it beside the conversion's own I/O; numba stays unimported."""
    import importlib.util
    import os

    llvmlite = importlib.util.find_spec("llvmlite")
    if llvmlite is None:
        pytest.skip("numba is not installed")
    library = next(Path(next(iter(llvmlite.submodule_search_locations))).rglob("libllvmlite*.so*"))
    code = f"""
import os, sys, threading
from k3lab.formats.direct_io import in_page_cache
from k3lab.formats.mxfp4 import warm_kernel
fd = os.open({str(library)!r}, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (its clean pages dropped: as from a cold cache)
before = in_page_cache(fd)
warm_kernel()
for thread in threading.enumerate():
    if thread.name == "k3lab-mxfp4-warm":
        thread.join()
import time
for _ in range(100):  # (the kernel reads what it was asked for on its own time)
    if in_page_cache(fd):
        break
    time.sleep(0.1)
print(before, in_page_cache(fd), "numba" in sys.modules)
"""
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    if out.split()[0] == "True":  # (a filesystem in memory, or pages another process has mapped)
        pytest.skip(f"{library}: its pages cannot be dropped here, so there is nothing to ask for")
    assert out.split() == ["False", "True", "False"], out


def test_a_failed_background_write_is_raised_once_and_the_queue_is_drained() -> None:
    """`hashing.wait` raises the first failure only after everything queued before it is done (their
    buffers are still in use), and leaves nothing behind: the thread's next run starts clean."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from k3lab.formats import hashing

    release = threading.Event()
    done: list[int] = []

    def fail() -> None:
        raise OSError(28, "No space left on device")

    def slow() -> None:
        release.wait(5)
        done.append(1)

    with ThreadPoolExecutor(2) as pool:
        hashing.track(pool.submit(fail))
        hashing.track(pool.submit(slow))
        threading.Timer(0.2, release.set).start()
        try:
            hashing.wait()
        except OSError as e:
            assert e.errno == 28
        else:
            raise AssertionError("the failure was not raised")
        assert done == [1]  # the later write was waited for
        hashing.wait()  # and nothing of the failed run is left to raise again


def test_a_task_asks_the_disk_for_its_first_bytes_up_front() -> None:
    """`Reader.start`: the first `nbytes` of the tensors, in the order they are written, are hinted
    (whole tensors, then part of the one the budget ends in), and nothing beyond."""
    from k3lab.formats.safetensors import TensorEntry
    from k3lab.pipeline.writing.convert import Reader

    class Hints:
        def __init__(self) -> None:
            self.log: list[tuple[str, int, int]] = []

        def will_need(self, entry: TensorEntry, offset: int, nbytes: int) -> None:
            self.log.append((entry.name, offset, nbytes))

    entries = {
        n: TensorEntry(n, "U8", (size,), 8, size, "shard.safetensors")
        for n, size in [("a", 100), ("b", 300), ("c", 500), ("d", 50)]
    }
    source = Hints()
    Reader(source, entries).start(["b", "a", "c", "d"], 600)  # type: ignore[arg-type]
    assert source.log == [("b", 0, 300), ("a", 0, 100), ("c", 0, 200)]
