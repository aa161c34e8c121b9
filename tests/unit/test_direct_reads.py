"""Reading a source (`k3lab/formats/direct_io.py`: `FileReads`, `ReadBuffers`), with O_DIRECT from a
file the page cache does not hold and with plain reads from one it holds: every range read, ahead or
not, is the file's own bytes; a buffer is never lent again while an array over it lives; what is held
ahead or free stays bounded; a file that shrank, a filesystem that refuses O_DIRECT's reads and a
released file each end as they should. The judge is the file read with Python's own `read`."""

from __future__ import annotations

import errno
import fcntl
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
    STALE_READS,
    FileReads,
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


def _open(path: Path, direct: bool) -> FileReads:
    reads = FileReads(os.open(path, os.O_RDONLY), ReadBuffers(), direct)
    assert reads.direct == direct, f"{path.parent}: this filesystem refuses O_DIRECT"
    return reads


ranges = st.tuples(st.integers(0, SIZE - 1), st.integers(1, 70_000)).map(
    lambda r: (r[0], min(r[1], SIZE - r[0]))
)


@settings(max_examples=60, deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.booleans(), ranges), min_size=1, max_size=25))
def test_every_range_read_ahead_or_not_is_the_files_own_bytes(
    data_file: tuple[Path, bytes], direct: bool, steps: list[tuple[bool, tuple[int, int]]]
) -> None:
    """Any mix of hints and reads at any offsets, direct or not: each read gives the file's bytes,
    read-only, and the arrays kept from earlier reads still hold theirs (no buffer lent twice at once)."""
    path, data = data_file
    reads = _open(path, direct)
    try:
        kept: list[tuple[np.ndarray, bytes]] = []
        for hint, (start, n) in steps:
            if hint:
                reads.ahead(start, n)
                continue
            got = reads.read(start, n)
            assert not got.flags.writeable
            assert got.tobytes() == data[start : start + n]
            kept.append((got, data[start : start + n]))
        for got, want in kept:
            assert got.tobytes() == want
        assert reads.buffers.ahead <= READ_AHEAD
    finally:
        reads.close()
    assert reads.buffers.ahead == 0


def test_a_hint_serves_the_pieces_it_holds_and_buffers_come_back(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One hint of 3 pieces serves all three from its one read (no read of the file after it); once
    the arrays are gone their buffer is lent again, and the free ones stay under ``READ_KEEP``."""
    path, data = data_file
    reads = _open(path, True)
    preads: list[int] = []
    real = os.preadv

    def counted(fd: int, bufs: list, offset: int, *flags: int) -> int:
        preads.append(offset)
        return real(fd, bufs, offset, *flags)

    try:
        reads.ahead(1000, 90_000)
        reads.read(1000, 1).tobytes()  # (waits for the read ahead)
        monkeypatch.setattr(direct_io.os, "preadv", counted)
        pieces = [reads.read(1000 + k * 30_000, 30_000) for k in range(3)]
        assert not preads  # all three from the buffer read ahead
        assert b"".join(p.tobytes() for p in pieces) == data[1000:91_000]
        assert reads.buffers.ahead == 0  # the last piece ended the read ahead
        del pieces
        assert len(reads.buffers._free) == 1
        again = reads.read(5, 10)  # lent again: no new buffer
        assert again.tobytes() == data[5:15] and not reads.buffers._free
    finally:
        reads.close()
    buffers = ReadBuffers()
    for n in (9 << 20, 9 << 20, 9 << 20, 1 << 20):
        buffers.give(buffers.take(n))
    assert sum(map(len, buffers._free)) <= READ_KEEP


def test_hints_side_by_side_are_read_as_one(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two hints queued behind a running read, the second beginning where the first ends (an expert's
    weights, then its scales): one read of both, each piece its own bytes; a hint that would grow
    that read past ``MERGED_READ`` is a read of its own."""
    path, data = data_file
    reads = _open(path, True)
    gate, preads = threading.Event(), []
    real = os.preadv

    def held(fd: int, bufs: list, offset: int, *flags: int) -> int:
        preads.append(offset)
        gate.wait(10)  # (the first read runs and waits: the hints after it queue behind it)
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(direct_io.os, "preadv", held)
    monkeypatch.setattr(direct_io, "MERGED_READ", 100_000)
    try:
        reads.ahead(0, 4096)
        reads.ahead(8192, 50_000)
        reads.ahead(58_192, 40_000)  # joined: 90,000 bytes in all
        reads.ahead(98_192, 20_000)  # would make 110,000: a read of its own
        gate.set()
        pieces = [reads.read(8192, 50_000), reads.read(58_192, 40_000), reads.read(98_192, 20_000)]
        assert [p.tobytes() for p in pieces] == [data[8192:58_192], data[58_192:98_192], data[98_192:118_192]]
        assert preads == [0, 8192, 98_192 - 98_192 % 4096], preads
    finally:
        reads.close()
    assert reads.buffers.ahead == 0


def test_a_read_past_a_hint_ends_it_and_a_dropped_hint_is_never_read(
    data_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hint cut short of a piece (a task's first hint, say) gives back its budget once a read runs
    past its end, not eight reads later; a hint dropped before its read began is never read."""
    path, data = data_file
    reads = _open(path, True)
    try:
        reads.ahead(0, 90_000)
        assert reads.read(0, 60_000).tobytes() == data[:60_000]  # (from the hint)
        assert reads.buffers.ahead == 90_000
        assert reads.read(60_000, 60_000).tobytes() == data[60_000:120_000]  # past its end
        assert reads.buffers.ahead == 0
        real, offsets = os.preadv, []

        def slow(fd: int, bufs: list, offset: int, *flags: int) -> int:
            offsets.append(offset)
            if offset == 0:  # (the thread's first read: long enough for nine reads of the caller)
                time.sleep(1.0)
            return real(fd, bufs, offset, *flags)

        monkeypatch.setattr(direct_io.os, "preadv", slow)
        reads.ahead(0, 4096)  # the thread is busy with this one...
        reads.ahead(180_224, 4096)  # ...while this one waits, and is dropped as stale:
        for _ in range(STALE_READS + 1):
            reads.read(8192, 10)
        for _ in range(500):  # (the thread empties its queue, then ends)
            if reads._thread is None:
                break
            time.sleep(0.01)
        reads.close()
        assert 180_224 not in offsets and reads.buffers.ahead == 0
    finally:
        if reads._thread is not None:
            reads.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_file_that_shrank_is_a_short_read_not_a_crash(tmp_path: Path, direct: bool) -> None:
    """A mapped page past a file's end is SIGBUS; a read past it says where the file ends."""
    path = tmp_path / "shrinking.bin"
    path.write_bytes(bytes(50_000))
    reads = _open(path, direct)
    try:
        os.truncate(path, 30_000)
        reads.ahead(40_000, 10_000)
        for start in (40_000, 25_000):  # (the error of a read ahead, and of a read now)
            with pytest.raises(ShortFile, match=r"the file ends at byte 3\d{4}, before byte "):
                reads.read(start, 10_000)
    finally:
        reads.close()


def test_reads_the_filesystem_refuses_are_read_plain(tiny_src: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that takes O_DIRECT but refuses its reads (EINVAL: a block larger than 4 KiB): the
    source reads the same bytes without it, from then on, and says nothing."""
    from k3lab.pipeline.sources.local import LocalSource

    source = LocalSource(tiny_src)
    name = max(source.weight_map, key=lambda n: source.entry(n).nbytes)
    entry = source.entry(name)
    want = source.array(name).view(np.uint8).reshape(-1)[100:5000].tobytes()
    real = os.preadv

    def refuse(fd: int, bufs: list, offset: int, *flags: int) -> int:
        if not flags and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(direct_io.os, "preadv", refuse)
    evict(Path(entry.file))
    fresh = LocalSource(tiny_src)
    fresh.acquire(entry.file)
    fresh.will_need(entry, 100, 4900)  # (refused on the reading thread)
    assert fresh.read_piece(entry, 100, 4900).tobytes() == want
    reads = fresh._open[entry.file]
    assert not reads.direct
    assert fresh.read_piece(entry, 100, 4900).tobytes() == want
    fresh.release(entry.file)


@pytest.mark.parametrize("cached", [True, False])
def test_a_shard_that_shrank_under_a_source_is_one_line_naming_it(
    tiny_src: Path, tmp_path: Path, cached: bool
) -> None:
    import shutil

    from k3lab.pipeline.sources.base import SourceError
    from k3lab.pipeline.sources.local import LocalSource

    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    source = LocalSource(src)
    name = max(source.weight_map, key=lambda n: source.entry(n).nbytes)
    entry = source.entry(name)
    if not cached:
        evict(Path(entry.file))
    source.acquire(entry.file)
    os.truncate(entry.file, entry.start + 10)
    with pytest.raises(SourceError) as e:
        source.read_piece(entry, 0, entry.nbytes)
    assert source._open[entry.file].direct != cached
    assert str(e.value).startswith(f"{entry.file}: tensor {name}: cannot read bytes {entry.start}+")
    assert "the file ends at byte" in str(e.value) and "\n" not in str(e.value)
    source.release(entry.file)


def test_a_released_file_leaves_no_reading_thread_and_no_descriptor(
    tiny_src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Release waits for the reads ahead still running (slowed here), then closes the file: no thread
    reads a descriptor that may be closed and reused."""
    from k3lab.pipeline.sources.local import LocalSource

    real = os.preadv

    def slow(fd: int, bufs: list, offset: int, *flags: int) -> int:
        if not flags:  # (a read, not the page cache asked)
            time.sleep(0.2)
        return real(fd, bufs, offset, *flags)

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("k3lab-read")}

    source = LocalSource(tiny_src)
    file = source.files()[0]  # (acquired and released by its name, as a task does)
    entries = sorted(source.header(file).values(), key=lambda e: e.start)
    before = readers()
    monkeypatch.setattr(direct_io.os, "preadv", slow)
    source.acquire(file)
    for e in entries:
        source.will_need(e, 0, e.nbytes)
    started = readers() - before
    assert started and source._buffers.ahead > 0
    fd = source._open[entries[0].file].fd
    source.release(file)
    assert not any(t.is_alive() for t in started)
    assert source._buffers.ahead == 0 and not source._open
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_a_file_in_the_page_cache_is_read_plain_one_on_disk_only_direct(tmp_path: Path) -> None:
    """What the page cache holds costs no disk to copy; what it does not hold is read with O_DIRECT
    (10x less system time than through the cache, `docs/benchmarks.md`). The cache is asked without
    waiting."""
    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 32 << 20, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        assert in_page_cache(fd)  # just written
        evict(path)
        assert not in_page_cache(fd)
        os.pread(fd, 64 << 10, 0)  # its start read again (a header, say): still on disk only
        assert not in_page_cache(fd)
        path.read_bytes()
        assert in_page_cache(fd)
    finally:
        os.close(fd)
    # asking reads nothing: of a sparse file (holes: what `synth --preset full` writes) a read that
    # must not wait would have the kernel's readahead zero-fill the pages, and the next ask says cached
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as fh:
        fh.truncate(64 << 20)
    evict(sparse)
    fd = os.open(sparse, os.O_RDONLY)
    try:
        assert [in_page_cache(fd) for _ in range(3)] == [False] * 3
    finally:
        os.close(fd)

    def unmappable(*args: object, **kwargs: object) -> None:
        raise OSError(19, "No such device")  # (a filesystem that cannot map files)

    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(direct_io.mmap, "mmap", unmappable)
            assert not in_page_cache(fd)  # asked, not raised: read direct
    finally:
        os.close(fd)
    empty = tmp_path / "empty.bin"
    empty.touch()
    fd = os.open(empty, os.O_RDONLY)
    assert not in_page_cache(fd)
    os.close(fd)


def test_a_conversion_read_direct_writes_the_bytes_of_one_read_from_the_cache(
    tiny_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny checkpoint converted as if in the page cache (plain reads) and as if on disk only
    (O_DIRECT): every piece read the way its mode says (counted), and the same file, byte for byte."""
    import hashlib

    from k3lab.cli import main
    from k3lab.pipeline.sources import base

    modes: list[bool] = []
    real_read = FileReads.read

    def recorded(self: FileReads, start: int, nbytes: int) -> np.ndarray:
        modes.append(self.direct)
        return real_read(self, start, nbytes)

    monkeypatch.setattr(FileReads, "read", recorded)
    digests = {}
    for cached in (True, False):
        monkeypatch.setattr(base, "in_page_cache", lambda fd, cached=cached: cached)
        out = tmp_path / str(cached)
        assert main(["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--quiet"]) == 0
        digests[cached] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.glob("*.gguf")}
        assert len(modes) > 10 and set(modes) == {not cached}, (cached, set(modes))
        modes.clear()
    assert digests[True] == digests[False] and digests[True]
