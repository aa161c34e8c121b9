"""Opening files that may be hostile: a FIFO, a device, a directory, a symlink into /proc, a huge file.

Every input and state file k3lab reads goes through here. A file is opened non-blocking (opening a
FIFO for reading would otherwise wait forever for a writer), ``fstat``-checked as a regular file on
the descriptor it will read (no check-then-open race), and whole-file reads are bounded: a file
over its limit, or one whose size the kernel reports as 0 but that yields more (``/proc``), is
refused. Any failure is one ``InputFileError`` naming the file. Nothing here knows a model.

Files k3lab *creates* are opened with ``O_NOFOLLOW | O_EXCL``: never through a symlink, never over
a file somebody else made (see ``pipeline.state``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from k3lab.errors import K3LabError

MiB = 1024 * 1024
PARTIAL = ".partial"  # a file being written; renamed to its name once whole


def partial_path(path: Path, pid: int | None = None) -> Path:
    """Where ``path`` is written before it is renamed into place: ``NAME.partial`` (one writer of the
    name at a time: a folder's lock says so), or ``NAME.PID.partial`` (writers that may overlap)."""
    return path.with_name(f"{path.name}.{pid}{PARTIAL}" if pid is not None else path.name + PARTIAL)


class InputFileError(K3LabError):
    """A file that is not a regular file of sane size, or cannot be read: one line naming it."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symlink"
    return "not a regular file"


def open_regular(path: str | os.PathLike, what: str = "file", follow: bool = True) -> tuple[int, int]:
    """A read-only descriptor of ``path`` and its size, checked on that descriptor to be a regular
    file. ``follow=False`` refuses a symlink (state files k3lab made itself are never symlinks)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InputFileError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise InputFileError(f"{path}: is a directory, not a {what}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InputFileError(f"{path}: is a symlink; k3lab does not follow symlinks here") from None
        raise InputFileError(f"{path}: cannot open the {what} ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(f"{path}: is {_kind(st.st_mode)}, not a {what}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_chunks(
    path: str | os.PathLike, limit: int, what: str = "file", follow: bool = True
) -> Iterator[bytes]:
    """A regular file of at most ``limit`` bytes, in chunks (a file over the limit, or one that yields
    more than its size says, as ``/proc`` files do, is one line)."""
    fd, size = open_regular(path, what, follow)
    try:
        if size > limit:
            raise InputFileError(
                f"{path}: {size} bytes; a {what} is at most {limit} bytes (is this the right file?)"
            )
        total = 0
        while chunk := os.read(fd, min(limit + 1 - total, 16 * MiB) or 1):
            total += len(chunk)
            if total > limit:
                raise InputFileError(f"{path}: more than {limit} bytes; a {what} is not this large")
            if total > size:
                # procfs, sysfs and the like say 0 (or less than they yield) and make their bytes as
                # they are read: /proc/self/environ would be the process's environment, tokens and all
                raise InputFileError(
                    f"{path}: yields more than the {size} bytes its size says (a file the kernel makes"
                    f" as it is read?); a {what} is a plain file"
                )
            yield chunk
    except OSError as e:
        raise InputFileError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)


def read_bounded(path: str | os.PathLike, limit: int, what: str = "file", follow: bool = True) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes."""
    return b"".join(read_chunks(path, limit, what, follow))


def within(path: str | os.PathLike, root: str | os.PathLike, what: str = "file") -> Path:
    """``path`` with every link resolved, refused in one line when that leads out of ``root`` (a
    checkpoint's file that is a link to somewhere else on the machine is not the checkpoint's)."""
    real, top = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if real != top and top not in real.parents:
        raise InputFileError(
            f"{path}: the {what} is a link out of {root} (to {real}); k3lab reads it only inside"
        )
    return real


def file_identity(path: str | os.PathLike) -> dict[str, int] | None:
    """What tells a regular file's bytes unchanged without reading them: size, mtime and ctime (ns),
    inode and device, links followed (None: not a regular file, or gone). A write changes mtime and
    ctime, and ctime cannot be set back; a file replaced by another has another inode or ctime.
    (``state.proof.identity`` is the output side's: files k3lab made, never links, as records keep it.)"""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "dev": st.st_dev,
    }


def read_text(path: str | os.PathLike, limit: int, what: str = "file", follow: bool = True) -> str:
    data = read_bounded(path, limit, what, follow)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{path}: the {what} is not UTF-8 ({e})") from None


MAX_DEPTH = 32  # JSON k3lab reads nests 6 levels at most (a manifest); nothing real nests 32


# a JSON text k3lab reads from outside has at most this many values and objects: what Python makes
# of it is then bounded (~100 bytes a value, ~250 an object: under 1.3 GB at worst), while Kimi-K3's
# largest (the manifest of its set: ~500,000 source objects, ~2.5M values; its index: ~500,000
# entries) fits with room
MAX_ITEMS, MAX_OBJECTS = 8_000_000, 2_000_000


SHAPE_STEP = 1 << 20  # bytes scanned at once by ``json_shape`` (its temporaries: ~40 bytes per byte)


_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'"{}[],:')


def json_shape(data: bytes) -> tuple[int, int, int]:
    return json_counts(data)[:3]


def json_counts(data: bytes) -> tuple[int, int, int, int]:
    """(how deep brackets nest, how many commas separate values, how many objects open, how many
    colons pair a key with a value), strings left out: counted in one
    linear pass, a MiB at a time, with no regular expression and no recursion (json.loads recurses,
    and a pattern for strings can be made to backtrack over every quote of crafted text: quadratic
    time). A quote ends a string unless an odd run of backslashes precedes it."""
    if b"\\" not in data:
        # without a backslash only the quotes and the six structural bytes decide these counts: the
        # rest is dropped at C speed first (Kimi-K3's headers, 76 MB, keep 12 MB; 1.35 s became 0.24 s)
        data = data.translate(None, _NOT_STRUCTURAL)
    top = depth = commas = objects = colons = 0
    inside, run = 0, 0  # within a string after the bytes so far; backslashes ending them
    for at in range(0, len(data), SHAPE_STEP):
        b = np.frombuffer(data, dtype=np.uint8, count=min(SHAPE_STEP, len(data) - at), offset=at)
        n = b.size
        if run == 0 and data.find(b"\\", at, at + n) < 0:
            # no backslash (a safetensors header has none): every quote opens or closes a string
            quote = b == 0x22
            flips = np.cumsum(quote, dtype=np.int32)
            outside = ((flips + inside) & 1 == 0) & ~quote
            steps = (b == 0x7B).view(np.int8) + (b == 0x5B).view(np.int8)
            steps -= (b == 0x7D).view(np.int8) + (b == 0x5D).view(np.int8)
            steps[~outside] = 0
            levels = np.cumsum(steps, dtype=np.int32) + depth
            top, depth = max(top, int(levels.max())), int(levels[-1])
            commas += int(np.count_nonzero(outside & (b == 0x2C)))
            objects += int(np.count_nonzero(outside & (b == 0x7B)))
            colons += int(np.count_nonzero(outside & (b == 0x3A)))
            inside = int(flips[-1] + inside) & 1
            continue
        idx = np.arange(n, dtype=np.int64)
        last_plain = np.maximum.accumulate(np.where(b != 0x5C, idx, -1))  # last non-backslash so far
        before = np.empty(n, dtype=np.int64)  # backslashes right before each byte
        before[0] = run
        before[1:] = idx[:-1] - last_plain[:-1] + np.where(last_plain[:-1] < 0, run, 0)
        real = (b == 0x22) & (before % 2 == 0)
        flips = np.cumsum(real, dtype=np.int64) + inside
        outside = ~(((flips % 2) == 1) | real)
        steps = ((b == 0x7B) | (b == 0x5B)).astype(np.int64) - ((b == 0x7D) | (b == 0x5D))
        levels = np.cumsum(np.where(outside, steps, 0)) + depth
        top, depth = max(top, int(levels.max())), int(levels[-1])
        commas += int(np.count_nonzero(outside & (b == 0x2C)))
        objects += int(np.count_nonzero(outside & (b == 0x7B)))
        colons += int(np.count_nonzero(outside & (b == 0x3A)))
        inside = int(flips[-1] % 2)
        run = int(n - 1 - last_plain[-1]) + (run if last_plain[-1] < 0 else 0)
    return top, commas, objects, colons


def json_depth(data: bytes) -> int:
    """How deep brackets nest (strings left out), counted without recursion (json.loads recurses)."""
    return json_shape(data)[0]


def parse_json(
    data: bytes,
    where: str,
    max_depth: int = MAX_DEPTH,
    max_items: int = MAX_ITEMS,
    max_objects: int = MAX_OBJECTS,
    **kwargs: Any,
) -> Any:
    """JSON from outside (a file, a Hub answer) with its shape bounded before it is parsed: anything
    but valid UTF-8 JSON nesting at most ``max_depth`` levels, of at most ``max_items`` values, is one
    ``InputFileError`` naming ``where`` (so memory is bounded by the items, not by what Python makes
    of a text of millions of tiny objects)."""
    depth, commas, objects = json_shape(data)
    if depth > max_depth:
        raise InputFileError(f"{where}: JSON nested {depth} levels deep; at most {max_depth} is expected")
    if commas >= max_items or objects > max_objects:
        raise InputFileError(
            f"{where}: JSON of {commas + 1} values and {objects} objects; at most {max_items} and "
            f"{max_objects} are expected"
        )
    try:
        return json.loads(data.decode("utf-8"), **kwargs)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InputFileError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from None


def read_json(path: str | os.PathLike, limit: int, what: str = "JSON file") -> Any:
    """Parsed JSON of a bounded regular file; invalid or absurdly nested JSON is one line naming it."""
    return parse_json(read_bounded(path, limit, what), str(path))


def open_lock_file(path: str | os.PathLike, what: str = "lock file") -> int:
    """A lock file opened (created if missing) for ``flock``: never through a symlink, and only a
    regular file; anything else is one line naming it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InputFileError(
                f"{path}: is a symlink; k3lab never writes through one (remove it)"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputFileError(f"{path}: is not a regular file; k3lab uses it as a {what}")
    return fd


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (where the filesystem lets a directory be fsynced: some
    refuse, and the rename itself has happened either way)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write(fh)`` into ``path.PID.partial`` (created new, never through a symlink), fsync, rename:
    ``path`` is old or new, never half, and a symlink at ``path`` is refused, not replaced. A failure
    removes the partial file (only a regular file of that name: k3lab's own) and is raised as it is."""
    tmp = partial_path(path, os.getpid())  # concurrent writers never share one
    try:
        remove_regular(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with open(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if path.is_symlink():
            raise InputFileError(f"{path}: is a symlink; k3lab never writes through one (remove it)")
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        remove_regular(tmp)
        raise


def cache_home() -> Path:
    """k3lab's own cache folder: ``K3LAB_CACHE``, else ``$XDG_CACHE_HOME/k3lab``, else ``~/.cache/k3lab``."""
    if os.environ.get("K3LAB_CACHE"):
        return Path(os.environ["K3LAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")) / "k3lab"


def is_regular_file(path: Path) -> bool:
    """Whether ``path`` itself (not a symlink's target) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_regular(path: Path) -> bool:
    """Delete ``path`` if it is a regular file (k3lab's own, by its name: a partial of an earlier,
    killed write); a symlink or anything else of that name is left alone. Whether it deleted one."""
    if not is_regular_file(path):
        return False
    path.unlink(missing_ok=True)
    return True


def json_bytes(data: Any, indent: int | None = None) -> bytes:
    return (json.dumps(data, indent=indent, sort_keys=True) + "\n").encode("utf-8")


SPAN_READ = 16 * 1024 * 1024  # bytes read at once when hashing a span of an open file


def hash_span(fh: BinaryIO, nbytes: int, advance: Callable[[int], Any] | None = None) -> str:
    """The SHA-256 of the next ``nbytes`` of ``fh`` (fewer where the file ends first: then it is
    not the hash a full span would have), read in bounded pieces; ``advance(n)`` after each."""
    h, left = hashlib.sha256(), nbytes
    while left:
        chunk = fh.read(min(SPAN_READ, left))
        if not chunk:
            break
        h.update(chunk)
        left -= len(chunk)
        if advance is not None:
            advance(len(chunk))
    return h.hexdigest()
