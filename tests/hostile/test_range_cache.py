"""The range cache proves what it serves (#37): an entry whose bytes changed is never served, a range
answers only for the file it was fetched for (repo, commit, path, id), nothing in the cache that is
not a regular file is opened or written through, a cache smaller than one range still serves every
read, and a range that fails a check (the Hub once served it wrong) is fetched once more, so it never
outlives the Hub's fix. Judged by the bytes returned and by what was fetched."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3lab.errors import K3LabError
from k3lab.pipeline.hub import range_files
from k3lab.pipeline.hub.ranges import FileIdentity, RangeCache

DATA = np.random.default_rng(7).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
FILE = FileIdentity("moonshotai/Kimi-K3", "a" * 40, "model-00001-of-000096.safetensors", "b" * 64)


class Hub:
    """A file's bytes served by range, counting what was asked."""

    def __init__(self, data: bytes = DATA):
        self.data, self.asked = data, []

    def __call__(self, start: int, stop: int) -> bytes:
        self.asked.append((start, stop))
        return self.data[start:stop]


def _put(path: Path, data: bytes) -> None:
    """Write a file as a hostile hand would, but never block or follow: an earlier edit may have
    made that name a FIFO (opening it to write would wait for a reader) or a link."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_NOFOLLOW, 0o644)
    except OSError:  # (ENXIO: a FIFO with no reader; ELOOP: a link)
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.write(fd, data)
    finally:
        os.close(fd)


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in (root / "ranges").rglob("*") if p.is_file() and not p.is_symlink())


def test_a_range_is_fetched_once_and_then_served_proved(tmp_path: Path) -> None:
    cache, hub = RangeCache(tmp_path, 1 << 30), Hub()
    assert bytes(cache.read(FILE, 100, 5000, hub)) == DATA[100:5000]
    assert bytes(cache.read(FILE, 200, 300, hub)) == DATA[200:300]  # inside the held range
    assert hub.asked == [(100, 5000)]
    (entry,) = _entries(tmp_path)
    # the documented layout: ranges/<sha256 of the identity>/<start>-<stop>.<sha256 of the bytes>
    key = hashlib.sha256(
        b'["moonshotai/Kimi-K3", "'
        + b"a" * 40
        + b'", "model-00001-of-000096.safetensors", "'
        + b"b" * 64
        + b'"]'
    ).hexdigest()
    assert entry.parent.name == key == FILE.key
    assert entry.name == f"100-5000.{hashlib.sha256(DATA[100:5000]).hexdigest()}"


@pytest.mark.parametrize("edit", ["flip", "cut", "grow", "swap"])
def test_an_entry_whose_bytes_changed_is_dropped_and_fetched_again(tmp_path: Path, edit: str) -> None:
    cache, hub = RangeCache(tmp_path, 1 << 30), Hub()
    cache.read(FILE, 0, 4096, hub)
    (entry,) = _entries(tmp_path)
    body = bytearray(entry.read_bytes())
    if edit == "flip":  # a disk fault, or a hand edit of one byte
        body[1000] ^= 0x40
    elif edit == "cut":  # a crash's short write
        body = body[:2048]
    elif edit == "grow":
        body += b"\0" * 10
    else:  # the bytes of another range of the same length
        body = bytearray(DATA[4096:8192])
    entry.write_bytes(bytes(body))
    assert bytes(cache.read(FILE, 10, 20, hub)) == DATA[10:20]
    assert hub.asked == [(0, 4096), (10, 20)] and cache.counts.dropped == 1
    assert [p.name.split(".")[0] for p in _entries(tmp_path)] == ["10-20"]  # the changed one is gone


@pytest.mark.parametrize("other", ["repo", "commit", "path"])
def test_a_range_answers_only_for_the_file_it_was_fetched_for(tmp_path: Path, other: str) -> None:
    """Another repo (or commit, or path) whose listing claims the same SHA-256 never reads it."""
    cache = RangeCache(tmp_path, 1 << 30)
    cache.read(FILE, 0, 1024, Hub())
    theirs = FileIdentity(
        "someone/else" if other == "repo" else FILE.repo,
        "c" * 40 if other == "commit" else FILE.commit,
        "x.safetensors" if other == "path" else FILE.path,
        FILE.oid,
    )
    stranger = Hub(bytes(reversed(DATA)))
    assert bytes(cache.read(theirs, 0, 1024, stranger)) == bytes(reversed(DATA))[:1024]
    assert stranger.asked == [(0, 1024)]
    assert bytes(cache.read(FILE, 0, 1024, Hub())) == DATA[:1024]  # and the first is still its own


def test_a_fifo_in_the_cache_is_passed_over_never_waited_on(tmp_path: Path) -> None:
    cache, hub = RangeCache(tmp_path, 1 << 30), Hub()
    folder = tmp_path / "ranges" / FILE.key
    folder.mkdir(parents=True)
    os.mkfifo(folder / f"0-4096.{hashlib.sha256(DATA[:4096]).hexdigest()}")
    done: list[bytes] = []
    reader = threading.Thread(target=lambda: done.append(bytes(cache.read(FILE, 0, 4096, hub))), daemon=True)
    reader.start()
    reader.join(30)
    assert done == [DATA[:4096]], "a read waited on a FIFO"
    assert (folder / f"0-4096.{hashlib.sha256(DATA[:4096]).hexdigest()}").is_fifo()  # not k3lab's: kept


@pytest.mark.parametrize("linked", ["ranges", "key"])
def test_a_linked_cache_folder_is_never_written_through(tmp_path: Path, linked: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("a user's file\n")
    root = tmp_path / "cache"
    if linked == "ranges":
        root.mkdir()
        (root / "ranges").symlink_to(elsewhere)
    else:
        (root / "ranges").mkdir(parents=True)
        (root / "ranges" / FILE.key).symlink_to(elsewhere)
    cache, hub = RangeCache(root, 1), Hub()
    for _ in range(2):
        assert bytes(cache.read(FILE, 0, 4096, hub)) == DATA[:4096]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["precious.txt"]  # nothing written there
    assert len(hub.asked) == 2  # served, not cached


def test_a_root_the_user_links_to_another_disk_is_theirs_to_choose(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "cache").symlink_to(disk)
    cache, hub = RangeCache(tmp_path / "cache", 1 << 30), Hub()
    cache.read(FILE, 0, 100, hub)
    cache.read(FILE, 0, 100, hub)
    assert hub.asked == [(0, 100)] and len(list((disk / "ranges").rglob("0-100.*"))) == 1


def test_a_cache_smaller_than_one_range_serves_every_read(tmp_path: Path, monkeypatch) -> None:
    """K3LAB_CACHE_SIZE=1 with many readers at once (as a view warms its tensors): each range is
    evicted as the next is stored, and every read still returns its bytes (read or mapped)."""
    monkeypatch.setattr(range_files, "MAP_FROM", 4096)  # the mapped path too
    cache = RangeCache(tmp_path, 1)
    spans = [(s, s + n) for s in range(0, 60000, 3000) for n in (100, 5000)]
    results: dict[tuple[int, int], bytes] = {}
    errors: list[BaseException] = []

    def read(span: tuple[int, int]) -> None:
        try:
            for _ in range(3):
                results[span] = bytes(cache.read(FILE, *span, Hub()))
        except BaseException as e:  # noqa: BLE001 (collected for the assertion)
            errors.append(e)

    threads = [threading.Thread(target=read, args=(s,)) for s in spans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == {s: DATA[s[0] : s[1]] for s in spans}
    assert sum(p.stat().st_size for p in _entries(tmp_path)) <= 5000  # at most the last one kept


def test_an_entry_evicted_while_it_is_read_keeps_its_bytes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(range_files, "MAP_FROM", 4096)
    cache = RangeCache(tmp_path, 1 << 30)
    held = cache.read(FILE, 0, 32768, Hub())  # mapped
    shutil.rmtree(tmp_path / "ranges")  # another process evicts everything
    assert bytes(held) == DATA[:32768]


def _fits(data: np.ndarray) -> None:
    """A check as a header's is: the first 8 bytes are a length that fits."""
    if struct.unpack("<Q", bytes(data[:8]))[0] > 1 << 20:
        raise K3LabError("header length does not fit")


def test_a_range_that_fails_its_check_is_fetched_once_more(tmp_path: Path) -> None:
    good = struct.pack("<Q", 1000) + DATA[8:4096]
    bad = struct.pack("<Q", 1 << 40) + DATA[8:4096]
    cache = RangeCache(tmp_path, 1 << 30)
    # served wrong once (a flipped byte on the way), right the next time: the right bytes, kept
    answers = iter([bad, good])
    assert bytes(cache.read(FILE, 0, 4096, lambda a, b: next(answers), _fits)) == good
    assert [p.name.split(".")[1] for p in _entries(tmp_path)] == [hashlib.sha256(good).hexdigest()]
    # served wrong every time: the check's error, and nothing of it left behind
    other = FileIdentity(FILE.repo, FILE.commit, "other.safetensors", "d" * 64)
    with pytest.raises(K3LabError, match="does not fit"):
        cache.read(other, 0, 4096, lambda a, b: bad, _fits)
    assert not list((tmp_path / "ranges" / other.key).iterdir())
    # the Hub fixed: read right at once (the wrong range did not outlive the fix)
    assert bytes(cache.read(other, 0, 4096, lambda a, b: good, _fits)) == good


def test_a_held_range_that_fails_its_check_is_dropped_and_fetched_again(tmp_path: Path) -> None:
    """A range stored without a check, read later with one it fails: dropped, fetched, checked."""
    good = struct.pack("<Q", 1000) + DATA[8:4096]
    cache = RangeCache(tmp_path, 1 << 30)
    cache.read(FILE, 0, 4096, lambda a, b: struct.pack("<Q", 1 << 40) + DATA[8:4096])
    hub = Hub(good)
    assert bytes(cache.read(FILE, 0, 4096, hub, _fits)) == good and hub.asked == [(0, 4096)]
    assert bytes(cache.read(FILE, 0, 4096, hub, _fits)) == good and hub.asked == [(0, 4096)]


def test_distrust_drops_every_range_of_a_file(tmp_path: Path) -> None:
    cache = RangeCache(tmp_path, 1 << 30)
    for span in ((0, 10), (100, 200), (300, 400)):
        cache.read(FILE, *span, Hub())
    assert cache.distrust(FILE) == 3 and not _entries(tmp_path)


# --- any state of the cache -------------------------------------------------------------------------

EDITS = st.sampled_from(["flip", "cut", "fifo", "link", "dir", "evict", "none", "partial"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spans=st.lists(st.tuples(st.integers(0, 60000), st.integers(1, 5000)), min_size=1, max_size=6),
    edits=st.lists(EDITS, min_size=1, max_size=6),
    limit=st.sampled_from([1, 6000, 1 << 30]),
)
def test_any_cache_state_serves_the_files_bytes_or_fetches_them(
    tmp_path_factory: pytest.TempPathFactory, spans, edits, limit
) -> None:
    """Whatever state the cache is left in (entries flipped, cut, replaced by a FIFO, a link or a
    folder, evicted, partials lying around) and whatever its bound, every read returns exactly the
    file's bytes, within one fetch per read (bound: a read costs at most its own range once more,
    and never waits: each example runs in well under a second)."""
    root = tmp_path_factory.mktemp("cache")
    cache, hub = RangeCache(root, limit), Hub()
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    for (start, n), edit in zip(spans, edits * len(spans)):
        stop = min(len(DATA), start + n)
        cache.read(FILE, start, stop, hub)
        for entry in _entries(root)[:1]:
            if edit == "flip" and entry.stat().st_size:
                body = bytearray(entry.read_bytes())
                body[0] ^= 1
                _put(entry, bytes(body))
            elif edit == "cut":
                _put(entry, entry.read_bytes()[:-1])
            elif edit in ("fifo", "link", "dir"):
                entry.unlink()
                {"fifo": os.mkfifo, "dir": os.mkdir}.get(edit, lambda p: p.symlink_to(elsewhere / "x"))(entry)
            elif edit == "evict":
                entry.unlink()
            elif edit == "partial":
                _put(entry.parent / f".{entry.name}.1.2.partial", b"half")
    for start, n in spans:
        stop = min(len(DATA), start + n)
        before = len(hub.asked)
        assert bytes(cache.read(FILE, start, stop, hub)) == DATA[start:stop]
        assert len(hub.asked) - before <= 1
    assert not list(elsewhere.iterdir())


# --- on the Hub, through the source notebooks, plans and converts use -------------------------------

REPO = "moonshotai/Kimi-K3"
SHARD = "model-00002-of-000011.safetensors"


def _hub_source(hub, meta: Path, repo: str = REPO):
    from k3lab.pipeline.sources.hub import HubSource, hub_spec

    source = HubSource(
        hub_spec(meta, repo, endpoint=hub.url, meta_files=("config.json", "model.safetensors.index.json"))
    )
    source.fetch_meta()
    return source


def _local_header(path: Path) -> bytes:
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    return path.read_bytes()[8 : 8 + n]


def test_a_repo_claiming_anothers_sha256_is_read_for_its_own_bytes(
    tiny_src: Path, tmp_path: Path, monkeypatch
) -> None:
    """Repo B lists a shard with repo A's SHA-256 but holds other bytes: once A's headers are cached,
    B's plan still reads B's (then B's download fails its SHA-256: the listing lied)."""
    from hub_server import HubServer

    theirs = tmp_path / "theirs"
    shutil.copytree(tiny_src, theirs)
    body = bytearray((theirs / SHARD).read_bytes())
    at = body.find(b'"pt"') + 2
    body[at] ^= 0x01  # "pt" -> "pu": a header that parses, but is not A's
    (theirs / SHARD).write_bytes(bytes(body))
    with HubServer(tiny_src) as hub:
        monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        hub.add_repo("someone/Kimi-K3-copy", theirs)
        hub.claims[("someone/Kimi-K3-copy", SHARD)] = hashlib.sha256(
            (tiny_src / SHARD).read_bytes()
        ).hexdigest()
        mine = _hub_source(hub, tmp_path / "meta-a")
        assert mine.remote(SHARD).oid == hashlib.sha256((tiny_src / SHARD).read_bytes()).hexdigest()
        mine.header(SHARD)
        other = _hub_source(hub, tmp_path / "meta-b", "someone/Kimi-K3-copy")
        assert other.remote(SHARD).oid == mine.remote(SHARD).oid  # the lie
        before = hub.served_bytes(SHARD)
        other.header(SHARD)
        assert hub.served_bytes(SHARD) > before  # fetched from B, not answered by A's ranges
        raw, _ = other._fetch_raw_header(SHARD)
        assert raw == _local_header(theirs / SHARD) != _local_header(tiny_src / SHARD)


def _convert_from_hub(hub, tmp: Path, out: Path) -> tuple[int, str]:
    from conftest import run_cli

    env = hub.client_env(tmp)
    r = run_cli(env, "convert", "--repo", REPO, "--meta", str(tmp / "meta"), "--out-dir", str(out), "--quiet")
    return r.returncode, r.stderr


def test_a_header_the_hub_once_served_wrong_does_not_outlive_the_fix(
    tiny_src: Path, tiny_one: Path, tmp_path: Path
) -> None:
    """The Hub serves a shard's header with a byte flipped (it no longer parses): the plan fetches
    it once more, then fails in one line; the Hub fixed, the next run converts (nothing of the wrong
    range was kept), byte-identical to a local conversion."""
    from hub_server import HubServer

    with HubServer(tiny_src) as hub:
        hub.flip[SHARD] = 8  # the header's opening brace
        code, err = _convert_from_hub(hub, tmp_path, tmp_path / "out")
        assert code == 2 and SHARD in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        header_reads = [r for p, r, _ in hub.served if p == SHARD and r.startswith("bytes=0-")]
        assert len(header_reads) == 3, header_reads  # its length, the header, the header once more
        del hub.flip[SHARD]  # the Hub fixed
        code, err = _convert_from_hub(hub, tmp_path, tmp_path / "out")
        assert code == 0, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.gguf")} == {
        p.name: p.read_bytes() for p in tiny_one.glob("*.gguf")
    }


def test_a_header_read_wrong_that_parses_is_caught_by_the_download_and_forgotten(
    tiny_src: Path, tiny_one: Path, tmp_path: Path
) -> None:
    """A flipped byte that still parses ("pt" -> "pu") makes a plan of the wrong header; the task's
    download (SHA-256 checked) contradicts it: one line, and the file's ranges are forgotten, so the
    next run, the Hub fixed, plans from the right bytes and converts."""
    from hub_server import HubServer

    at = (tiny_src / SHARD).read_bytes().find(b'"pt"') + 2
    with HubServer(tiny_src) as hub:
        hub.flip[SHARD] = at
        code, err = _convert_from_hub(hub, tmp_path, tmp_path / "out")
        assert code != 0 and "header differs from the one the plan was made from" in err, err
        assert SHARD in err and "Traceback" not in err
        del hub.flip[SHARD]
        code, err = _convert_from_hub(hub, tmp_path, tmp_path / "out")
        assert code == 0, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.gguf")} == {
        p.name: p.read_bytes() for p in tiny_one.glob("*.gguf")
    }


def test_a_full_cache_disk_is_one_line_naming_the_path(tmp_path: Path) -> None:
    """The range cache on a disk with no room: one line naming the entry's path and what to do, the
    half-written entry gone (not ``[Errno 28]`` alone)."""
    import subprocess

    from k3lab.errors import MachineError

    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"SKIPPED LOUDLY: cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        cache = RangeCache(mnt, 1 << 30)
        with pytest.raises(MachineError) as e:
            cache.read(FILE, 0, len(DATA), Hub())
        said = str(e.value)
        assert "\n" not in said and said.startswith(str(mnt / "ranges")) and "no space left" in said, said
        assert "K3LAB_CACHE" in said, said
        assert not [p for p in mnt.rglob("*") if p.is_file()]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
