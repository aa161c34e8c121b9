"""ggml's own quantisation kernels, called through ctypes: the libggml-base that llama-cpp-python
installs (``llama_cpp/lib``), the library llama.cpp's ``llama-quantize`` itself is built on.

Nothing here re-implements a kernel. What k3lab needs of ggml, and the calls that give it:

    ggml_get_type_traits(type)   a type's name, block size, bytes per block, whether it is quantised,
                                 and its ``to_float`` (the dequantiser llama-quantize uses)
    ggml_bf16_to_fp32_row        BF16 and F16 widened as llama-quantize widens them
    ggml_fp16_to_fp32_row
    ggml_quantize_chunk          rows of float32 to a type, with an importance vector per column
    ggml_quantize_requires_imatrix   the types whose kernel asserts an imatrix
    ggml_validate_row_data       the check llama-quantize makes of every quantised slab
    ggml_version, ggml_commit    which ggml this is (a variant's digest names it)

Rows are independent in every kernel: the bytes of a row depend on its values and its imatrix
only, never on which chunk or thread made it, so a file quantised a slab at a time on any number of
threads is the file ``llama-quantize`` writes. ggml's asserts abort the process: every call here is
checked first (row widths a multiple of the block, an imatrix where the kernel wants one, buffers
of the right size), so bad input is one line, never an abort.

ctypes releases the GIL during a foreign call: threads calling ``quantize`` use every core.
This module knows bytes and types, not models.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3lab.errors import K3LabError

# ggml_type ids (ggml/include/ggml.h of the tree llama-cpp-python 0.3.36 vendors); ids are ggml's
# file format, stable across versions
TYPE_IDS = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9,
    "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15,
    "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22,
    "IQ4_XS": 23, "I8": 24, "I16": 25, "I32": 26, "I64": 27, "F64": 28, "IQ1_M": 29, "BF16": 30,
    "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39, "NVFP4": 40, "Q1_0": 41, "Q2_0": 42,
}  # fmt: skip
TYPE_NAMES = {v: k for k, v in TYPE_IDS.items()}
# the types ggml_quantize_chunk makes (its switch; any other asserts) and gguf-py 0.19 reads (not Q2_0):
# what a tensor may become
QUANTIZE_TARGETS = frozenset(
    TYPE_IDS[n]
    for n in (
        "F32", "F16", "BF16", "Q1_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "NVFP4",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S",
        "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
    )
)  # fmt: skip


class GGMLError(K3LabError):
    """ggml cannot be loaded, or a call would break one of its preconditions."""


class GGMLMissing(GGMLError):
    """llama-cpp-python (and so ggml's kernels) is not installed: exit 1, the machine's."""

    exit_code = 1


@dataclass(frozen=True)
class TypeTraits:
    name: str
    block: int  # values per block
    block_bytes: int  # bytes per block
    quantized: bool

    def row_bytes(self, n: int) -> int:
        if n % self.block:
            raise GGMLError(
                f"{self.name}: a row of {n} values is not a multiple of its block of {self.block}"
            )
        return n // self.block * self.block_bytes


class _Traits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
# The names tried, first found wins: on Linux the soname llama.cpp's own libraries link against
# first, since a wheel holds the library under each name as a separate copy and two copies loaded
# are two ggmls (two loggers, two sets of tables) in one process.
_LIB_NAMES = {
    "linux": ("libggml-base.so.0", "libggml-base.so"),
    "darwin": ("libggml-base.0.dylib", "libggml-base.dylib"),
    "win32": ("ggml-base.dll",),
}


def library_path() -> Path:
    """Where llama-cpp-python keeps libggml-base (found without importing llama_cpp, which would load
    all of llama.cpp)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise GGMLMissing(
            "quantising needs llama.cpp's ggml, which llama-cpp-python installs: "
            "pip install 'k3lab[llama]' (it builds llama.cpp: about 10 minutes on 2 cores)"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "lib"
    names = _LIB_NAMES.get(sys.platform, _LIB_NAMES["linux"])
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise GGMLMissing(f"{folder / names[-1]}: llama-cpp-python is installed without its ggml library")


class GGML:
    """The loaded library; ``ggml()`` gives the one per process."""

    def __init__(self, path: Path):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise GGMLMissing(f"{path}: cannot load ggml ({e})") from None
        self.path = path
        f = lib.ggml_get_type_traits
        f.argtypes, f.restype = [ctypes.c_int], ctypes.POINTER(_Traits)
        f = lib.ggml_quantize_chunk
        f.argtypes = (
            [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
        )
        f.restype = ctypes.c_size_t
        f = lib.ggml_quantize_requires_imatrix
        f.argtypes, f.restype = [ctypes.c_int], ctypes.c_bool
        f = lib.ggml_validate_row_data
        f.argtypes, f.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_bool
        for name in ("ggml_bf16_to_fp32_row", "ggml_fp16_to_fp32_row"):
            f = getattr(lib, name)
            f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
        for name in ("ggml_version", "ggml_commit"):
            f = getattr(lib, name)
            f.argtypes, f.restype = [], ctypes.c_char_p
        self._lib = lib
        self._to_float: dict[int, _TO_FLOAT] = {}

    @functools.cached_property
    def version(self) -> str:
        """ggml's version and commit: a variant's bytes are these kernels' (its digest names them)."""
        return f"{self._lib.ggml_version().decode()}+{self._lib.ggml_commit().decode()}"

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one instance per process, for its whole life)
    def traits(self, type_id: int) -> TypeTraits:
        if type_id not in TYPE_NAMES:
            raise GGMLError(f"ggml type {type_id}: not a type ggml writes to files")
        t = self._lib.ggml_get_type_traits(type_id).contents
        if t.blck_size <= 0 or t.type_size <= 0:
            raise GGMLError(f"ggml type {TYPE_NAMES[type_id]}: removed from this ggml")
        return TypeTraits(t.type_name.decode(), int(t.blck_size), int(t.type_size), bool(t.is_quantized))

    def requires_imatrix(self, type_id: int) -> bool:
        return bool(self._lib.ggml_quantize_requires_imatrix(type_id))

    def to_float(self, type_id: int, src: np.ndarray, out: np.ndarray) -> None:
        """``src`` (bytes of whole rows of ``type_id``) widened into ``out`` (float32, one value per
        element), as llama-quantize widens a tensor before quantising it."""
        tr = self.traits(type_id)
        n = out.size
        if out.dtype != np.float32 or not out.flags.c_contiguous or not src.flags.c_contiguous:
            raise GGMLError("to_float: contiguous buffers (float32 out) only")
        if n % tr.block or src.nbytes != n // tr.block * tr.block_bytes:
            raise GGMLError(f"{tr.name}: {src.nbytes} bytes are not {n} values")
        if type_id == TYPE_IDS["F32"]:
            out[...] = src.view(np.float32).reshape(out.shape)
            return
        sp, op = src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p)
        if type_id == TYPE_IDS["BF16"]:
            self._lib.ggml_bf16_to_fp32_row(sp, op, n)
        elif type_id == TYPE_IDS["F16"]:
            self._lib.ggml_fp16_to_fp32_row(sp, op, n)
        elif tr.quantized:
            fn = self._to_float.get(type_id)
            if fn is None:
                ptr = self._lib.ggml_get_type_traits(type_id).contents.to_float
                if not ptr:
                    raise GGMLError(f"{tr.name}: ggml has no dequantiser for it")
                fn = self._to_float[type_id] = _TO_FLOAT(ptr)
            fn(sp, op, n)
        else:
            raise GGMLError(f"{tr.name}: cannot be widened to F32 (llama-quantize refuses it too)")

    def quantize(
        self,
        type_id: int,
        rows: np.ndarray,
        out: np.ndarray,
        imatrix: np.ndarray | None = None,
        validate: bool = True,
    ) -> int:
        """``rows`` (float32 [nrows, n_per_row]) quantised to ``type_id`` into ``out`` (uint8, exactly
        nrows rows of the type), with ``imatrix`` (float32 [n_per_row]) for every row; checked with
        ggml's own row validation, as llama-quantize checks (``validate``: the caller checks them
        itself: ggml's check prints a line of its own when it fails). Returns the bytes written."""
        tr = self.traits(type_id)
        if type_id not in QUANTIZE_TARGETS:
            raise GGMLError(f"{tr.name}: ggml does not quantise to it")
        if rows.dtype != np.float32 or rows.ndim != 2 or not rows.flags.c_contiguous:
            raise GGMLError("quantize: rows must be C-contiguous float32 [nrows, n_per_row]")
        nrows, n_per_row = rows.shape
        need = nrows * tr.row_bytes(n_per_row)
        if out.dtype != np.uint8 or out.nbytes != need or not out.flags.c_contiguous:
            raise GGMLError(f"quantize: {tr.name} needs a {need}-byte buffer, got {out.nbytes}")
        if imatrix is not None:
            if imatrix.dtype != np.float32 or imatrix.shape != (n_per_row,) or not imatrix.flags.c_contiguous:
                raise GGMLError(f"quantize: the imatrix must be float32 [{n_per_row}]")
            im = imatrix.ctypes.data_as(ctypes.c_void_p)
        elif self.requires_imatrix(type_id):
            raise GGMLError(f"{tr.name}: ggml's kernel needs an importance matrix (--imatrix)")
        else:
            im = None
        op = out.ctypes.data_as(ctypes.c_void_p)
        size = self._lib.ggml_quantize_chunk(
            type_id, rows.ctypes.data_as(ctypes.c_void_p), op, 0, nrows, n_per_row, im
        )
        if size != need:
            raise GGMLError(f"{tr.name}: ggml wrote {size} bytes for {nrows} rows, expected {need}")
        if validate and not self._lib.ggml_validate_row_data(type_id, op, size):
            raise GGMLError(
                f"{tr.name}: ggml's check of the quantised rows failed (NaN or inf in the input?)"
            )
        return size

    def validate(self, type_id: int, data: np.ndarray) -> bool:
        """ggml's own check of whole rows of ``type_id`` (what llama.cpp's loader checks)."""
        return bool(
            self._lib.ggml_validate_row_data(type_id, data.ctypes.data_as(ctypes.c_void_p), data.nbytes)
        )


@functools.cache
def ggml() -> GGML:
    """The ggml of the installed llama-cpp-python, loaded once per process."""
    return GGML(library_path())


def type_id(name: str) -> int:
    """A ggml type by name, as llama-quantize parses one (any case)."""
    found = TYPE_IDS.get(name.upper())
    if found is None:
        raise GGMLError(f"{name!r}: not a ggml type (one of {', '.join(sorted(TYPE_IDS))})")
    return found
