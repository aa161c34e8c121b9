"""MXFP4: compressed-tensors ``mxfp4-pack-quantized`` -> ggml ``block_mxfp4``, and reference decoders.

Source (compressed-tensors, per Linear):
    weight_packed  uint8 [rows, cols/2]   byte k of a row = element 2k (low nibble) | element 2k+1 (high)
    weight_scale   uint8 [rows, cols/32]  E8M0 biased exponent; value = e2m1(code) * 2**(e - 127)
    code = sign << 3 | index into E2M1 {0, .5, 1, 1.5, 2, 3, 4, 6}

Target (ggml type 39, 17 bytes per 32 values along a row):
    byte 0      the same E8M0 byte
    bytes 1..16 byte j = element j (low nibble) | element j+16 (high nibble)

ggml stores the E2M1 table doubled and halves the scale, so neither the scale byte nor the codes
change: the repack is a pure nibble permutation inside each block, and therefore lossless.

Within one 32-value block with source bytes b[0..15] (b[m] holds elements 2m, 2m+1), the target
bytes are, for m in 0..7:
    t[2m]   = (b[m] & 0x0F) | (b[8+m] & 0x0F) << 4     elements 2m and 2m+16
    t[2m+1] = (b[m] >> 4)   | (b[8+m] & 0xF0)          elements 2m+1 and 2m+17

The compiled kernel does all eight m at once: with L = b[0..7] and H = b[8..15] read as two
little-endian 64-bit words, t[2m] is byte m of (L & 0x0F..0F) | (H & 0x0F..0F) << 4 and t[2m+1] is
byte m of (L >> 4 & 0x0F..0F) | (H & 0xF0..F0).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

import numpy as np

from k3lab.errors import K3LabError

QK = 32  # values per block
BLOCK_BYTES = 17  # 1 scale byte + 16 bytes of nibbles
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


class MXFP4ShapeError(K3LabError):
    """The packed or scale array does not have the shape or dtype MXFP4 requires."""


def row_bytes(cols: int) -> int:
    """GGML bytes of one row of ``cols`` MXFP4 values."""
    if cols % QK:
        raise MXFP4ShapeError(f"MXFP4 rows need a multiple of {QK} values, got {cols}")
    return cols // QK * BLOCK_BYTES


def check_pair(packed: np.ndarray, scale: np.ndarray, what: str = "tensor") -> tuple[int, int]:
    """Validate a (weight_packed, weight_scale) pair; return the logical (rows, cols)."""
    if packed.dtype != np.uint8:
        raise MXFP4ShapeError(f"{what}: weight_packed must be uint8, got {packed.dtype}")
    if scale.dtype != np.uint8:
        raise MXFP4ShapeError(f"{what}: weight_scale must be uint8 (E8M0), got {scale.dtype}")
    if packed.ndim != 2:
        raise MXFP4ShapeError(f"{what}: weight_packed must be 2-D [rows, cols/2], got shape {packed.shape}")
    rows, half = packed.shape
    cols = half * 2
    if cols % QK:
        raise MXFP4ShapeError(f"{what}: {cols} columns is not a multiple of {QK}")
    if scale.shape != (rows, cols // QK):
        raise MXFP4ShapeError(
            f"{what}: weight_scale shape {tuple(scale.shape)} does not match weight_packed "
            f"{tuple(packed.shape)} (expected {(rows, cols // QK)})"
        )
    return rows, cols


def _repack_numpy(packed: np.ndarray, scale: np.ndarray, out: np.ndarray) -> None:
    rows, cols = packed.shape[0], packed.shape[1] * 2
    nb = cols // QK
    src = packed.reshape(rows, nb, 16)
    dst = out.reshape(rows, nb, BLOCK_BYTES)
    lo, hi = src[:, :, :8], src[:, :, 8:]
    dst[:, :, 0] = scale
    dst[:, :, 1::2] = (lo & 0x0F) | (hi << 4)
    dst[:, :, 2::2] = (lo >> 4) | (hi & 0xF0)


def _repack_words(src: np.ndarray, scale: np.ndarray, dst: np.ndarray) -> None:  # pragma: no cover
    """The repack on 64-bit words, compiled by numba (``_kernel``)."""
    # src: flat uint64 (n_blocks*2, little-endian: word 0 = bytes 0..7); scale: flat (n_blocks);
    # dst: flat uint8 (n_blocks*17)
    n_blocks = scale.shape[0]
    low = np.uint64(0x0F0F0F0F0F0F0F0F)
    four = np.uint64(4)
    for blk in range(n_blocks):
        lo = src[2 * blk]
        hi = src[2 * blk + 1]
        even = (lo & low) | ((hi & low) << four)  # byte m: elements 2m, 2m+16
        odd = ((lo >> four) & low) | (hi & ~low)  # byte m: elements 2m+1, 2m+17
        d = blk * 17
        dst[d] = scale[blk]
        for m in range(8):
            shift = np.uint64(8 * m)
            dst[d + 1 + 2 * m] = np.uint8((even >> shift) & np.uint64(0xFF))
            dst[d + 2 + 2 * m] = np.uint8((odd >> shift) & np.uint64(0xFF))


@functools.lru_cache(maxsize=1)
def _kernel() -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
    """The compiled kernel, made on the first repack (numba costs ~70 MB and a few hundred ms to
    import: a process that converts no MXFP4 tensor never pays it). Compiled once per machine:
    numba's on-disk cache keeps it. None where numba is missing (the numpy path then serves)."""
    try:
        import numba
    except ImportError:  # pragma: no cover
        return None
    return numba.njit(cache=True, nogil=True, boundscheck=False)(_repack_words)


WARM_WINDOW = 1 << 20


def warm_kernel() -> None:
    """Ask the kernel for numba's and llvmlite's files (``posix_fadvise`` WILLNEED, on a thread of its
    own), without importing them: loading the kernel from a cold page cache reads 0.2 GB of them
    (llvmlite's library is 179 MB) and every installed package's ``entry_points.txt`` (numba looks
    for extensions), 0.5 s on an idle disk and over three times that beside a conversion's own reads
    and writes, which the first expert then waits for. A run asks before it plans; a process that
    converts no MXFP4 tensor still never imports numba."""
    import importlib.util
    import os

    def ask(path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:  # (Linux reads at most the readahead window per call: asked a window at a time)
            for at in range(0, os.fstat(fd).st_size, WARM_WINDOW):
                os.posix_fadvise(fd, at, WARM_WINDOW, os.POSIX_FADV_WILLNEED)
        except OSError:  # (a hint only: what is not read ahead is read when the kernel loads)
            pass
        finally:
            os.close(fd)

    def warm() -> None:
        tag, installed = sys.implementation.cache_tag, set()
        for name in ("llvmlite", "numba"):
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                continue
            package = next(iter(spec.submodule_search_locations))
            installed.add(os.path.dirname(package))
            for folder, _, files in os.walk(package):
                for f in files:
                    if f.endswith(".so") or (f.endswith(".pyc") and tag in f and "tests" not in folder):
                        ask(os.path.join(folder, f))
        for folder in installed:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.endswith(".dist-info"):
                        ask(os.path.join(entry.path, "entry_points.txt"))

    with _loading_lock:
        if _warming or _kernel.cache_info().currsize or not hasattr(os, "posix_fadvise"):
            return
        _warming.append(threading.Thread(target=warm, name="k3lab-mxfp4-warm", daemon=True))
    _warming[0].start()


_loading: list[threading.Thread] = []  # the kernel being loaded in the background (``load_kernel``)
_warming: list[threading.Thread] = []  # its files being asked for (``warm_kernel``): once a process
_loading_lock = threading.Lock()


def load_kernel() -> None:
    """Load the compiled kernel now, on a thread of its own (numba's import and its cached code take
    ~0.4 s): a task starts it before its header is written, so the loading overlaps the header and
    the disk's first reads instead of following them. The first repack waits for it."""
    with _loading_lock:
        if _loading or _kernel.cache_info().currsize:
            return

        def load() -> None:
            kernel = _kernel()
            if kernel is not None:  # (a first call loads the machine code numba keeps on disk)
                kernel(np.zeros(2, np.uint64), np.zeros(1, np.uint8), np.zeros(BLOCK_BYTES, np.uint8))

        thread = threading.Thread(target=load, name="k3lab-mxfp4-kernel", daemon=True)
        _loading.append(thread)
        thread.start()


def _loaded_kernel() -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
    """The kernel, once ``load_kernel``'s thread has loaded it (repacking the first pieces with numpy
    meanwhile, 0.56 GB/s against the kernel's 6 and beside a thread holding the interpreter, made a
    real-size layer file slower: 1.7-2.2 s against 1.4-1.6 s)."""
    if _loading:
        _loading[0].join()
    return _kernel()


def repack_into(
    packed: np.ndarray, scale: np.ndarray, out: np.ndarray | memoryview, what: str = "tensor"
) -> None:
    """Repack one matrix into ``out`` (any writable uint8 buffer of rows*row_bytes(cols) bytes)."""
    rows, cols = check_pair(packed, scale, what)
    dst = np.frombuffer(out, dtype=np.uint8) if not isinstance(out, np.ndarray) else out
    dst = dst.reshape(-1)
    need = rows * row_bytes(cols)
    if dst.size != need:
        raise MXFP4ShapeError(f"{what}: output buffer has {dst.size} bytes, MXFP4 needs {need}")
    src = np.ascontiguousarray(packed).reshape(-1)
    sc = np.ascontiguousarray(scale).reshape(-1)
    kernel = (
        _loaded_kernel()
        if dst.flags.c_contiguous and src.ctypes.data % 8 == 0 and sys.byteorder == "little"
        else None
    )
    if kernel is not None:
        kernel(src.view(np.uint64), sc, dst)
    else:
        _repack_numpy(src.reshape(rows, cols // 2), sc.reshape(rows, cols // QK), dst)


def repack(packed: np.ndarray, scale: np.ndarray, what: str = "tensor") -> np.ndarray:
    """Repack one matrix; returns uint8 [rows, cols/32*17] (gguf-py's byte shape for MXFP4)."""
    rows, cols = check_pair(packed, scale, what)
    out = np.empty((rows, row_bytes(cols)), dtype=np.uint8)
    repack_into(packed, scale, out, what)
    return out


def repack_experts(pairs: list[tuple[np.ndarray, np.ndarray]], what: str = "experts") -> np.ndarray:
    """Repack a stack of experts; returns uint8 [n_expert, rows, cols/32*17]."""
    if not pairs:
        raise MXFP4ShapeError(f"{what}: no experts to stack")
    rows, cols = check_pair(*pairs[0], what=f"{what}[0]")
    out = np.empty((len(pairs), rows, row_bytes(cols)), dtype=np.uint8)
    for e, (packed, scale) in enumerate(pairs):
        if packed.shape != pairs[0][0].shape:
            raise MXFP4ShapeError(
                f"{what}[{e}]: shape {packed.shape} differs from expert 0's {pairs[0][0].shape}"
            )
        repack_into(packed, scale, out[e], what=f"{what}[{e}]")
    return out


def repack_unpack_stack(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The straightforward repack (unpack every nibble to a code array, regroup, pack again).

    Kept as an independent second implementation for tests and as the benchmark's peer.
    """
    rows, cols = check_pair(packed, scale)
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    blocks = codes.reshape(rows, cols // QK, QK)
    qs = blocks[:, :, :16] | (blocks[:, :, 16:] << 4)
    return np.concatenate([scale.reshape(rows, cols // QK, 1), qs], axis=-1).reshape(rows, -1)


# --- reference decoders -------------------------------------------------------------------------


def decode_codes(codes: np.ndarray) -> np.ndarray:
    """E2M1 code (0..15) -> its value as float64 (code 8 is -0.0)."""
    codes = np.asarray(codes, dtype=np.uint8)
    mag = E2M1_VALUES[codes & 0x07]
    return np.where(codes & 0x08, -mag, mag)


def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """compressed-tensors packed bytes [.., n/2] -> codes [.., n] (element 2k is the low nibble)."""
    codes = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def decode_compressed_tensors(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Dequantise compressed-tensors MXFP4 to float32 by its own definition: e2m1 * 2**(e-127).

    The product is computed exactly (float64 holds every value) and rounded once to float32, so
    e=255 with a non-zero code overflows to inf, as 2**128 does in float32 arithmetic.
    """
    rows, cols = check_pair(packed, scale)
    values = decode_codes(unpack_codes(packed)).reshape(rows, cols // QK, QK)
    exps = scale.astype(np.int32).reshape(rows, cols // QK, 1) - 127
    with np.errstate(over="ignore"):
        return np.ldexp(values, exps).astype(np.float32).reshape(rows, cols)


def decode_ggml(blocks: np.ndarray, cols: int) -> np.ndarray:
    """Dequantise ggml block_mxfp4 bytes [rows, cols/32*17] to float32, by the block layout above."""
    rows = blocks.size // row_bytes(cols)
    b = np.asarray(blocks, dtype=np.uint8).reshape(rows, cols // QK, BLOCK_BYTES)
    qs = b[:, :, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15 then 16..31
    exps = b[:, :, :1].astype(np.int32) - 127
    with np.errstate(over="ignore"):
        return np.ldexp(decode_codes(codes), exps).astype(np.float32).reshape(rows, cols)


def quantize_compressed_tensors(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [rows, cols] -> (weight_packed, weight_scale) as compressed-tensors stores them.

    Used by the synthetic checkpoint generator: shared exponent floor(log2(amax)) - 2 (E2M1's
    largest value is 6 = 1.5 * 2**2), codes by nearest E2M1 value.
    """
    w = np.asarray(weights, dtype=np.float32)
    rows, cols = w.shape
    if cols % QK:
        raise MXFP4ShapeError(f"{cols} columns is not a multiple of {QK}")
    blocks = w.reshape(rows, cols // QK, QK)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2 + 127, 0)
    e = np.clip(e, 0, 254).astype(np.uint8)
    scaled = blocks / np.ldexp(1.0, e.astype(np.int32) - 127)[..., None]
    idx = np.abs(np.abs(scaled)[..., None] - E2M1_VALUES).argmin(axis=-1).astype(np.uint8)
    codes = idx | np.where(scaled < 0, 8, 0).astype(np.uint8)
    codes = codes.reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, e
