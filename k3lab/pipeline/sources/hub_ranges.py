"""The Hub source's ranged reads: looking inside a checkpoint without downloading it. A tensor's
bytes (or some of its rows) are fetched by ranged GETs at the pinned commit through the range cache
(``hub.ranges``), side by side when a view asks for many; a header exactly, its length then its JSON.
A file this source downloaded is read from disk instead. A mixin of ``hub.HubSource``."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from k3lab.formats.safetensors import MAX_HEADER, NUMPY_DTYPE, TensorEntry, parse_header
from k3lab.pipeline.hub import transport
from k3lab.pipeline.hub.ranges import Check, FileIdentity
from k3lab.pipeline.hub.retry import with_retries
from k3lab.pipeline.sources.base import SourceError, _row_range

WARM_THREADS = 8  # ranged reads in flight at once when a view asks for many tensors
WINDOW = 16 << 20  # a ranged read of a tensor reads this much of it at once (bounded memory)


class RangedReads:
    """(mixed into HubSource)"""

    def fetch(self, file: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of ``file`` at the pinned commit, by a ranged GET (not kept)."""
        remote = self.remote(file)
        url = transport.file_url(self.repo, file, self.commit or self.revision, self.endpoint)
        where = self.where(file)
        return with_retries(
            where,
            lambda: transport.fetch_range(url, start, stop, remote.size, self.token, where),
            self.budget,
        )

    def identity(self, file: str) -> FileIdentity:
        """What the range cache keys ``file``'s ranges by: this repo, the pinned commit, the path, its id."""
        self.resolve()
        return FileIdentity(self.repo, str(self.commit), file, self.remote(file).oid)

    def cached(self, file: str, start: int, stop: int, check: Check | None = None) -> np.ndarray:
        """Bytes ``[start, stop)`` of ``file`` through the range cache (fetched at most once; bytes
        that fail ``check`` are fetched once more)."""
        return self.cache.read(self.identity(file), start, stop, lambda a, b: self.fetch(file, a, b), check)

    def distrust(self, file: str) -> None:
        """``file``'s downloaded bytes (SHA-256 checked) contradict ranges read earlier: drop them."""
        self.cache.distrust(self.identity(file))

    def read_piece(self, entry: TensorEntry, offset: int, nbytes: int) -> np.ndarray:
        """A piece of a tensor: from the downloaded shard when this source holds it (converting),
        else by a ranged GET, never stored (``verify`` streaming a whole set through)."""
        file = self._labels.get(entry.file, entry.file)
        if file in self._slots:
            return super().read_piece(entry, offset, nbytes)
        if offset + nbytes > entry.nbytes:
            raise SourceError(f"{entry.file}: tensor {entry.name}: read past its {entry.nbytes} bytes")
        start, stop = entry.start + offset, entry.start + offset + nbytes
        with self._state:
            held = self._window.get(file)
        if held is None or not held[0] <= start or stop > held[0] + len(held[1]):
            # a window of the tensor from here (the streams read a tensor front to back, in pieces)
            end = min(entry.start + entry.nbytes, max(stop, start + WINDOW))
            held = (start, self.fetch(file, start, end))
            self.counts.add(fetched=len(held[1]), requests=1)
            with self._state:
                self._window[file] = held
        return np.frombuffer(held[1], dtype=np.uint8, count=nbytes, offset=start - held[0])

    def will_need(self, entry: TensorEntry, offset: int, nbytes: int) -> None:
        if self._labels.get(entry.file, entry.file) in self._slots:
            super().will_need(entry, offset, nbytes)

    def warm(self, names: list[str]) -> None:
        """Fetch these tensors into the range cache side by side (``WARM_THREADS`` ranged reads at
        once: the Hub's round trips overlap); those a downloaded shard holds need nothing."""
        jobs = []
        for name in names:
            e, file = self.entry(name), self.weight_map[name]
            if file not in self._slots:
                jobs.append((file, e.start, e.start + e.nbytes))
        if len(jobs) > 1:
            with ThreadPoolExecutor(WARM_THREADS, thread_name_prefix="k3lab-warm") as pool:
                for done in [pool.submit(self.cached, *job) for job in jobs]:
                    done.result()

    def array(self, name: str) -> np.ndarray:
        """A whole tensor, by ranges through the cache (a downloaded shard's when this source holds it)."""
        return self.rows(name)

    def rows(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        e, file = self.entry(name), self.weight_map[name]
        if file in self._slots:
            return super().rows(name, start, stop)
        first, last = _row_range(e, start, stop)
        data = self.cached(file, e.start + first, e.start + last)
        return data.view(NUMPY_DTYPE[e.dtype]).reshape(_row_shape(e, start, stop))

    def _fetch_raw_header(self, file: str) -> tuple[bytes, int]:
        """The shard's header by ranged reads at the commit, through the cache (exactly the bytes asked)."""
        size = self.remote(file).size
        if size < 8:
            raise SourceError(f"{self.where(file)}: {size} bytes is too short for a safetensors file")
        where = self.where(file)

        def fits(length: np.ndarray) -> None:
            (n,) = struct.unpack("<Q", bytes(length))
            if n > MAX_HEADER or 8 + n > size:
                raise SourceError(f"{where}: header length {n} does not fit the file ({size} bytes)")

        def parses(head: np.ndarray) -> None:
            parse_header(bytes(head[8:]), where, size)

        (n,) = struct.unpack("<Q", bytes(self.cached(file, 0, 8, fits)))
        # exactly the header: its length, then its JSON (a range that does not parse is fetched again)
        head = bytes(self.cached(file, 0, 8 + n, parses))
        return head[8 : 8 + n], size


def _row_shape(e: TensorEntry, start: int, stop: int | None) -> tuple[int, ...]:
    if not e.shape:
        return ()
    stop = e.shape[0] if stop is None else min(stop, e.shape[0])
    return (stop - min(max(start, 0), stop), *e.shape[1:])
