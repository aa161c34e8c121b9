"""The Hub source's downloads: each file an output file reads, downloaded whole into a slot k3lab
owns (``slots``), hashed as it arrives and checked against the Hub's SHA-256 before it is read; shared
by the tasks of one process that read it, kept for the next task that reads it too, deleted once
nobody does. A mixin of ``hub.HubSource``: it uses the source's pinned commit (``remote``), scratch and
retry budget."""

from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from k3lab.pipeline.hub import transport
from k3lab.pipeline.hub.files import RemoteFile, download
from k3lab.pipeline.hub.retry import HubError, HubUnreachable
from k3lab.pipeline.progress import NO_REPORT, Cancelled, TaskReport
from k3lab.pipeline.sources.slots import Slot, sweep_scratch

PREFETCH_AHEAD = 1  # files downloaded ahead of the ones converting
KEPT = 1  # files kept after their last task because the next one reads them too


class Downloads:
    """(mixed into HubSource)"""

    def acquire(self, file: str, report: TaskReport = NO_REPORT) -> None:
        """Download ``file`` (or wait for the download of it in flight: a prefetch, another task's)
        and check its SHA-256, ready to map until as many ``release``s."""
        with self._state:
            if file in self._slots:
                self._hold(file)
                return
            pending = self._pending.get(file)
            if pending is None:
                pending = self._pending[file] = Future()
                pending.set_running_or_notify_cancel()
                mine = True
            else:
                mine = False
        if mine:
            try:
                slot = self._fetch(file, report)
            except BaseException as e:
                with self._state:
                    self._pending.pop(file, None)
                pending.set_exception(e)
                raise
            pending.set_result(slot)
        else:
            while True:  # the download runs in another thread: hear a stop meanwhile
                try:
                    slot = pending.result(timeout=0.25)
                    break
                except FutureTimeout:
                    report.check()
        with self._state:
            self._pending.pop(file, None)
            self._prefetching.discard(file)
            self._slots.setdefault(file, slot)
            self._hold(file)

    def _hold(self, file: str) -> None:
        """(under ``_state``) one more hold of a file that is here."""
        with self._lock:
            self._holds[file] = self._holds.get(file, 0) + 1
        if file in self._kept:
            self._kept.remove(file)

    def prefetch(self, file: str, report: TaskReport = NO_REPORT) -> None:
        with self._state:
            if file in self._pending or file in self._slots or len(self._prefetching) >= PREFETCH_AHEAD:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="k3lab-prefetch")
            self._prefetching.add(file)
            self._pending[file] = self._pool.submit(self._fetch, file, report)

    def _fetch(self, file: str, report: TaskReport) -> Slot:
        """Download ``file`` at the pinned commit into its slot and check its bytes; returns the slot,
        held. A cut download continues from its last byte, in this run or the next (the slot's key
        is the file's name and SHA-256, so only the same bytes ever resume it); other bytes than the
        Hub lists, or a stop, remove the slot."""
        remote = self.remote(file)
        if self.scratch is None:
            raise HubError(f"{self.where(file)}: no scratch folder to download it into (give --scratch)")
        self.scratch.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha256(f"{file}\0{remote.oid}".encode()).hexdigest()[:32]
        sweep_scratch(self.scratch, keep=key)
        slot = Slot(self.scratch, key)
        slot.take(block=True)
        path = slot.folder / file
        try:
            if slot.kept_path.exists() and remote.matches(path):
                report.downloaded(remote.size)
                return slot
            slot.kept_path.unlink(missing_ok=True)
            partial = path.with_name(path.name + ".incomplete")
            digest = self._download(remote, partial, report)
            if digest != remote.oid:
                raise HubError(
                    f"{self.where(file)}: the downloaded bytes are not the ones the Hub lists "
                    f"(SHA-256 {remote.oid[:16]}..., {remote.size} bytes); the download was discarded"
                )
            os.replace(partial, path)  # (the final name only ever holds the checked bytes)
            if self.keep:
                slot.kept_path.touch()
            return slot
        except (Cancelled, HubUnreachable, KeyboardInterrupt):
            slot.release()  # (kept for the next attempt: its bytes are the Hub's, so far)
            raise
        except BaseException:
            slot.remove()
            raise

    def _download(self, remote: RemoteFile, path: Path, report: TaskReport) -> str:
        """The rest of ``remote``'s bytes into ``path`` (see ``hub.files.download``)."""
        url = transport.file_url(self.repo, remote.name, self.commit or self.revision, self.endpoint)
        return download(
            url, remote, path, self.token, self.where(remote.name), report, self._closing, self.budget
        )

    def release(self, file: str, keep: bool = False) -> bool:
        """Done with ``file`` (once per ``acquire``): once nobody holds it, close it and delete its
        download (``--keep-source``: keep it on disk), unless ``keep``: a next task reads it too, so
        it stays, one of at most ``KEPT`` (the oldest goes first)."""
        if not super().release(file):
            return False
        gone = []
        with self._state:
            if file not in self._slots:
                return True
            if keep and not self._closing.is_set():
                self._kept.append(file)
                while len(self._kept) > KEPT:
                    gone.append(self._kept.pop(0))
            else:
                gone.append(file)
            slots = [self._slots.pop(f) for f in gone]
        for slot in slots:
            if self.keep and slot.kept_path.exists():
                slot.release()
            else:
                slot.remove()
        return True

    def close(self) -> None:
        """Stop prefetches and delete what they and whole-tensor reads left (a run that stops early)."""
        self._closing.set()
        with self._state, self._lock:
            self._holds.clear()
            self._kept.clear()
        for file in list(self._acquired) + list(self._slots):
            self.release(file)
        with self._state:
            pending, self._pending = dict(self._pending), {}
        for fut in pending.values():
            with contextlib.suppress(BaseException):  # the download's own error is not this run's
                fut.result().remove()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._closing.clear()
