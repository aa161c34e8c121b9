"""Reading a source with O_DIRECT (`k3lab/formats/direct_io.py`: `DirectFile`, `ReadBuffers`): every
range read, ahead or not, is the file's own bytes; a buffer is never lent again while an array over it
lives; what is held ahead or free stays bounded; a file that shrank, a filesystem that refuses the
reads and a released file each end as they should. The judge is the file read with plain `read`."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3lab.formats import direct_io
from k3lab.formats.direct_io import (
    READ_AHEAD,
    READ_KEEP,
    DirectFile,
    ReadBuffers,
    ShortFile,
    in_page_cache,
)

SIZE = 200_003  # (not a whole number of blocks: the last read ends inside one)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("direct") / "data.bin"
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return path, data


def evict(*paths: Path) -> None:
    """Out of the page cache (as a checkpoint on disk and not read since is): a source reads it direct.
    The kernel drops only pages it has filed on its lists: pages read a moment ago by another core may
    not be yet, so it is asked again until they are gone (a few times at most)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            for _ in range(100):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if not in_page_cache(fd):
                    break
                time.sleep(0.01)
            assert not in_page_cache(fd), f"{path}: the page cache keeps it"
        finally:
            os.close(fd)


def _open(path: Path) -> tuple[int, DirectFile]:
    fd = os.open(path, os.O_RDONLY)
    direct = DirectFile.open(fd, ReadBuffers())
    assert direct is not None, (
        f"{path.parent}: this filesystem refuses O_DIRECT; the test reads nothing direct"
    )
    return fd, direct


ranges = st.tuples(st.integers(0, SIZE - 1), st.integers(1, 70_000)).map(
    lambda r: (r[0], min(r[1], SIZE - r[0]))
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), ranges), min_size=1, max_size=25))
def test_every_range_read_ahead_or_not_is_the_files_own_bytes(
    data_file: tuple[Path, bytes], steps: list[tuple[bool, tuple[int, int]]]
) -> None:
    """Any mix of hints and reads at any offsets: each read gives the file's bytes, read-only, and
    the arrays kept from earlier reads still hold theirs (no buffer lent twice at once)."""
    path, data = data_file
    fd, direct = _open(path)
    try:
        kept: list[tuple[np.ndarray, bytes]] = []
        for hint, (start, n) in steps:
            if hint:
                direct.ahead(start, n)
                continue
            got = direct.read(start, n)
            assert got is not None and not got.flags.writeable
            assert got.tobytes() == data[start : start + n]
            kept.append((got, data[start : start + n]))
        for got, want in kept:
            assert got.tobytes() == want
        assert direct.buffers.ahead <= READ_AHEAD
    finally:
        direct.close()
        os.close(fd)
    assert direct.buffers.ahead == 0


def test_a_hint_serves_the_pieces_it_holds_and_buffers_come_back(data_file: tuple[Path, bytes]) -> None:
    """One hint of 3 pieces serves all three from its one read (no read of the file after it); once
    the arrays are gone their buffer is lent again, and the free ones stay under ``READ_KEEP``."""
    path, data = data_file
    fd, direct = _open(path)
    reads: list[int] = []
    real = os.preadv

    def counted(fd_: int, bufs: list, offset: int) -> int:
        reads.append(offset)
        return real(fd_, bufs, offset)

    try:
        direct.ahead(1000, 90_000)
        direct.read(1000, 1).tobytes()  # (waits for the read ahead)
        os.preadv, before = counted, len(reads)
        pieces = [direct.read(1000 + k * 30_000, 30_000) for k in range(3)]
        assert len(reads) == before == 0  # all three from the buffer read ahead
        assert b"".join(p.tobytes() for p in pieces) == data[1000:91_000]
        assert direct.buffers.ahead == 0  # the last piece ended the read ahead
        del pieces
        assert len(direct.buffers._free) == 1
        again = direct.read(5, 10)  # lent again: no new buffer
        assert again.tobytes() == data[5:15] and not direct.buffers._free
    finally:
        os.preadv = real
        direct.close()
        os.close(fd)
    buffers = ReadBuffers()
    for n in (9 << 20, 9 << 20, 9 << 20, 1 << 20):
        buffers.give(buffers.take(n))
    assert sum(map(len, buffers._free)) <= READ_KEEP


def test_a_file_that_shrank_is_a_short_read_not_a_crash(tmp_path: Path) -> None:
    """A mapped page past a file's end is SIGBUS; a read past it says where the file ends."""
    path = tmp_path / "shrinking.bin"
    path.write_bytes(bytes(50_000))
    fd, direct = _open(path)
    try:
        os.truncate(path, 30_000)
        direct.ahead(40_000, 10_000)
        for start in (40_000, 25_000):  # (the error of a read ahead, and of a read now)
            with pytest.raises(ShortFile, match=r"the file ends at byte 3\d{4}, before byte "):
                direct.read(start, 10_000)
    finally:
        direct.close()
        os.close(fd)


def test_reads_the_filesystem_refuses_fall_back_to_mapping(
    tiny_src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that takes O_DIRECT but refuses the reads (EINVAL: a block larger than 4 KiB):
    the source maps the same bytes instead, and says nothing."""
    from k3lab.pipeline.sources.local import LocalSource

    source = LocalSource(tiny_src)
    name = max(source.weight_map, key=lambda n: source.entry(n).nbytes)
    entry = source.entry(name)
    want = source.array(name).view(np.uint8).reshape(-1)[100:5000].tobytes()

    real = os.preadv

    def refuse(fd: int, bufs: list, offset: int, *flags: int) -> int:
        if flags:  # (the page cache asked without waiting: not a direct read)
            return real(fd, bufs, offset, *flags)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io.os, "preadv", refuse)
    evict(Path(entry.file))
    fresh = LocalSource(tiny_src)
    fresh.acquire(entry.file)
    assert fresh.map(entry, 100, 4900).tobytes() == want
    direct = next(iter(fresh._direct.values()))
    assert direct is not None and direct.refused
    assert fresh.map(entry, 100, 4900).tobytes() == want  # (and stays mapped)
    fresh.release(entry.file)


def test_a_shard_that_shrank_under_a_source_is_one_line_naming_it(tiny_src: Path, tmp_path: Path) -> None:
    import shutil

    from k3lab.pipeline.sources.base import SourceError
    from k3lab.pipeline.sources.local import LocalSource

    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    source = LocalSource(src)
    name = max(source.weight_map, key=lambda n: source.entry(n).nbytes)
    entry = source.entry(name)
    evict(Path(entry.file))
    source.acquire(entry.file)
    os.truncate(entry.file, entry.start + 10)
    with pytest.raises(SourceError) as e:
        source.map(entry, 0, entry.nbytes)
    assert str(e.value).startswith(f"{entry.file}: tensor {name}: cannot read bytes {entry.start}+")
    assert "the file ends at byte" in str(e.value) and "\n" not in str(e.value)
    source.release(entry.file)


def test_a_released_file_leaves_no_reading_thread(tiny_src: Path) -> None:
    from k3lab.pipeline.sources.local import LocalSource

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("k3lab-read")}

    source = LocalSource(tiny_src)
    file = source.files()[0]  # (acquired and released by its name, as a task does)
    entries = sorted(source.header(file).values(), key=lambda e: e.start)
    evict(Path(entries[0].file))
    before = readers()
    source.acquire(file)
    for e in entries:
        source.will_need(e, 0, e.nbytes)
    started = readers() - before
    assert started and source._buffers.ahead > 0
    fd = source._fds[entries[0].file]
    source.release(file)
    assert not any(t.is_alive() for t in started)
    assert source._buffers.ahead == 0 and not source._fds
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_a_file_in_the_page_cache_is_mapped_one_on_disk_only_is_read_direct(tmp_path: Path) -> None:
    """Mapping what the page cache holds costs no disk; what it does not hold is read with O_DIRECT
    (10x less system time than mapped pages, `docs/benchmarks.md`). The cache is asked without waiting."""
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        assert in_page_cache(fd)  # just written
        evict(path)
        assert not in_page_cache(fd)
        os.pread(fd, 1 << 20, 0)  # the first third read again (a header, say): still on disk only
        assert not in_page_cache(fd)
        path.read_bytes()
        assert in_page_cache(fd)
    finally:
        os.close(fd)
    empty = tmp_path / "empty.bin"
    empty.touch()
    fd = os.open(empty, os.O_RDONLY)
    assert not in_page_cache(fd)
    os.close(fd)


def test_a_conversion_read_direct_writes_the_bytes_of_one_read_mapped(
    tiny_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny checkpoint converted from the page cache (mapped) and from disk (O_DIRECT, every
    piece: counted): the same file, byte for byte."""
    import hashlib
    import shutil

    from k3lab.cli import main
    from k3lab.pipeline.sources import base

    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    for mode in ("mapped", "direct"):
        if mode == "direct":  # (as if on disk only: what the page cache holds is the other test's)
            monkeypatch.setattr(base, "in_page_cache", lambda fd: False)
            monkeypatch.setattr(DirectFile, "read", counting)
        assert main(["convert", "--meta", str(src), "--out-dir", str(tmp_path / mode), "--quiet"]) == 0
    digests = {
        mode: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / mode).glob("*.gguf")}
        for mode in ("mapped", "direct")
    }
    assert digests["mapped"] == digests["direct"] and digests["mapped"]
    assert len(served) > 10 and all(got is not None for got in served)


served: list[np.ndarray | None] = []
_read = DirectFile.read


def counting(self: DirectFile, start: int, nbytes: int) -> np.ndarray | None:
    got = _read(self, start, nbytes)
    served.append(got)
    return got
