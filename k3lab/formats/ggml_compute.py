"""ggml's own CPU computation, through ctypes: the libggml-base and libggml-cpu that llama-cpp-python
installs, whose kernels llama.cpp runs a model with. A graph built here of ggml's operations
computes what llama.cpp's graph of the same operations computes, bit for bit: the same kernels (a
matrix product's activations converted to the weight's ``vec_dot_type``, BF16 for BF16, Q8_0 for
MXFP4; ``expf``, ``tanhf`` and the rest as ggml approximates them), in the same order.

- ``Weights`` (``ggml_weights``): tensors of any ggml type held once for every graph that uses them;
- ``Graph``: one computation: inputs copied in, ggml's operations (named as ggml names them: ``mul_mat``,
  ``rms_norm``, ``flash_attn_ext``, ``gated_delta_net`` ...) built on ``Tensor`` handles, computed on n
  threads by ``ggml_graph_compute_with_ctx``, any tensor of it read out afterwards (every tensor keeps
  its own memory: no allocator reuses it, so an intermediate, a product's input, is still there).

Nothing of a model here: shapes, types and names are the caller's. ctypes releases the GIL while
ggml computes. ggml asserts abort the process: the callers build only graphs llama.cpp builds.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3lab.formats.ggml import TYPE_IDS, GGMLError, library_path

F32, F16, I32 = TYPE_IDS["F32"], TYPE_IDS["F16"], TYPE_IDS["I32"]
PREC_F32 = 10  # enum ggml_prec
_NUMPY = {F32: np.float32, F16: np.float16, I32: np.int32}


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class TensorHead(ctypes.Structure):
    """The first fields of ggml's ``struct ggml_tensor`` (type, buffer, ne[4], nb[4]): stable since
    ggml began, and all that is read of a tensor here besides its data."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


class _CPlan(ctypes.Structure):
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


_P, _I64, _SZ, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float, ctypes.c_int
_BASE = {
    "ggml_init": ([_InitParams], _P),
    "ggml_free": ([_P], None),
    "ggml_new_tensor": ([_P, _I, _I, ctypes.POINTER(_I64)], _P),
    "ggml_get_data": ([_P], _P),
    "ggml_nbytes": ([_P], _SZ),
    "ggml_tensor_overhead": ([], _SZ),
    "ggml_graph_overhead_custom": ([_SZ, ctypes.c_bool], _SZ),
    "ggml_new_graph_custom": ([_P, _SZ, ctypes.c_bool], _P),
    "ggml_build_forward_expand": ([_P, _P], None),
    "ggml_row_size": ([_I, _I64], _SZ),
    # operations (as llama.cpp's graphs use them)
    "ggml_mul_mat": ([_P, _P, _P], _P),
    "ggml_mul_mat_id": ([_P, _P, _P, _P], _P),
    "ggml_get_rows": ([_P, _P, _P], _P),
    "ggml_rms_norm": ([_P, _P, _F], _P),
    "ggml_mul": ([_P, _P, _P], _P),
    "ggml_add": ([_P, _P, _P], _P),
    "ggml_div": ([_P, _P, _P], _P),
    "ggml_scale": ([_P, _P, _F], _P),
    "ggml_clamp": ([_P, _P, _F, _F], _P),
    "ggml_sum_rows": ([_P, _P], _P),
    "ggml_soft_max": ([_P, _P], _P),
    "ggml_sigmoid": ([_P, _P], _P),
    "ggml_tanh": ([_P, _P], _P),
    "ggml_silu": ([_P, _P], _P),
    "ggml_softplus": ([_P, _P], _P),
    "ggml_concat": ([_P, _P, _P, _I], _P),
    "ggml_cont": ([_P, _P], _P),
    "ggml_cont_2d": ([_P, _P, _I64, _I64], _P),
    "ggml_transpose": ([_P, _P], _P),
    "ggml_permute": ([_P, _P, _I, _I, _I, _I], _P),
    "ggml_reshape_2d": ([_P, _P, _I64, _I64], _P),
    "ggml_reshape_3d": ([_P, _P, _I64, _I64, _I64], _P),
    "ggml_reshape_4d": ([_P, _P, _I64, _I64, _I64, _I64], _P),
    "ggml_view_2d": ([_P, _P, _I64, _I64, _SZ, _SZ], _P),
    "ggml_view_3d": ([_P, _P, _I64, _I64, _I64, _SZ, _SZ, _SZ], _P),
    "ggml_view_4d": ([_P, _P, _I64, _I64, _I64, _I64, _SZ, _SZ, _SZ, _SZ], _P),
    "ggml_cast": ([_P, _P, _I], _P),
    "ggml_argsort_top_k": ([_P, _P, _I], _P),
    "ggml_ssm_conv": ([_P, _P, _P], _P),
    "ggml_gated_delta_net": ([_P, _P, _P, _P, _P, _P, _P, _I64], _P),
    "ggml_flash_attn_ext": ([_P, _P, _P, _P, _P, _F, _F, _F], _P),
    "ggml_flash_attn_ext_set_n_kv_max": ([_P, ctypes.c_int32], None),
    "ggml_prec_set_acc": ([_P, _I], ctypes.c_bool),
    "ggml_dsv4_hc_pre": ([_P, _P, _P], _P),
    # backend buffers (a weight ggml's CPU backend repacks lives in one of the repack type)
    "ggml_backend_alloc_ctx_tensors_from_buft": ([_P, _P], _P),
    "ggml_backend_tensor_set": ([_P, _P, _SZ, _SZ], None),
    "ggml_backend_buffer_free": ([_P], None),
    "ggml_log_get": ([_P, _P], None),
    # ggml's graph allocator: a graph's intermediates in one buffer, reused as they die
    "ggml_backend_cpu_buffer_type": ([], _P),
    "ggml_gallocr_new": ([_P], _P),
    "ggml_gallocr_free": ([_P], None),
    "ggml_gallocr_alloc_graph": ([_P, _P], ctypes.c_bool),
    "ggml_gallocr_reserve": ([_P, _P], ctypes.c_bool),
    "ggml_gallocr_get_buffer_size": ([_P, ctypes.c_int], _SZ),
    "ggml_set_input": ([_P], None),
    "ggml_set_output": ([_P], None),
    "ggml_log_set": ([_P, _P], None),
}

# ggml's log callback: (level, text, user data); the silent one drops what ggml says while it repacks
# (a line per tensor at DEBUG level that ggml's default logger prints whatever the level).
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_SILENT = _LOG_CALLBACK(lambda level, text, data: None)


class _Lib:
    def __init__(self) -> None:
        base_path = library_path()
        self.base = ctypes.CDLL(str(base_path))
        cpu_path = base_path.with_name(base_path.name.replace("ggml-base", "ggml-cpu"))
        try:
            self.cpu = ctypes.CDLL(str(cpu_path))
        except OSError as e:
            raise GGMLError(f"{cpu_path}: cannot load ggml's CPU backend ({e})") from None
        for name, (args, res) in _BASE.items():
            f = getattr(self.base, name)
            f.argtypes, f.restype = args, res
        for name in ("ggml_cpu_has_avx2", "ggml_cpu_has_neon", "ggml_cpu_has_dotprod"):
            getattr(self.cpu, name).argtypes, getattr(self.cpu, name).restype = [], _I
        # (a C++ function of libggml-cpu's: ggml_backend_cpu_repack_buffer_type())
        f = getattr(self.cpu, "_Z35ggml_backend_cpu_repack_buffer_typev", None)
        if f is not None:
            f.argtypes, f.restype = [], _P
        self.repack_buffer_type = f
        f = self.cpu.ggml_graph_plan
        f.argtypes, f.restype = [_P, _I, _P], _CPlan
        f = self.cpu.ggml_graph_compute
        f.argtypes, f.restype = [_P, ctypes.POINTER(_CPlan)], _I
        self.cpu.ggml_cpu_init.argtypes, self.cpu.ggml_cpu_init.restype = [], None
        self.cpu.ggml_cpu_init()


@functools.cache
def lib() -> _Lib:
    return _Lib()


def row_size(type_id: int, n: int) -> int:
    return int(lib().base.ggml_row_size(type_id, n))


class _Context:
    """A ggml context of ``size`` bytes for its tensors' memory (and their overhead), freed on
    ``close``; ``no_alloc``: tensors without memory (a graph measured, not computed)."""

    def __init__(
        self,
        size: int,
        n_tensors: int,
        graph_nodes: int = 0,
        no_alloc: bool = False,
        arena: Arena | None = None,
    ):
        L = lib()
        self.L = L
        mem = size + (n_tensors + 16) * L.base.ggml_tensor_overhead() + (1 << 20)
        if graph_nodes:
            mem += L.base.ggml_graph_overhead_custom(graph_nodes, False)
        self.ptr = L.base.ggml_init(_InitParams(mem, None, no_alloc))
        if not self.ptr:
            raise GGMLError(f"ggml could not make a context of {mem:,} bytes (out of memory?)")

    def new(self, type_id: int, ne: tuple[int, ...]) -> int:
        arr = (ctypes.c_int64 * len(ne))(*ne)
        t = self.L.base.ggml_new_tensor(self.ptr, type_id, len(ne), arr)
        if not t:
            raise GGMLError(f"ggml could not make a tensor of shape {list(ne)} (its context is full)")
        return t

    def close(self) -> None:
        if self.ptr:
            self.L.base.ggml_free(self.ptr)
            self.ptr = None


class Arena:
    """Memory a run of graphs reuses: ggml's graph allocator (its buffer kept and grown when a graph
    needs more) and ggml's work buffer, so that a graph computed chunk after chunk neither asks the
    system for fresh memory nor touches it page by page each time. One graph at a time uses it;
    ``close`` frees it."""

    ALIGN = 64

    def __init__(self) -> None:
        self._work: np.ndarray | None = None
        self._galloc = None

    def allocator(self) -> int:
        """ggml's graph allocator on the CPU's buffer type (made once)."""
        if self._galloc is None:
            L = lib().base
            self._galloc = L.ggml_gallocr_new(L.ggml_backend_cpu_buffer_type())
            if not self._galloc:
                raise GGMLError("ggml could not make a graph allocator")
        return self._galloc

    def work(self, n: int) -> int:
        """The address of ``n`` bytes for ggml's work buffer."""
        if self._work is None or self._work.size < n + self.ALIGN:
            self._work = np.empty(n + self.ALIGN, dtype=np.uint8)
        address = self._work.ctypes.data
        return address + -address % self.ALIGN

    def close(self) -> None:
        if self._galloc is not None:
            lib().base.ggml_gallocr_free(self._galloc)
            self._galloc = None
        self._work = None


def _memory(ptr: int) -> np.ndarray:
    """A contiguous tensor's memory as a writable uint8 array."""
    L = lib()
    n = L.base.ggml_nbytes(ptr)
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(L.base.ggml_get_data(ptr)))


@dataclass(frozen=True)
class Tensor:
    """A handle on a ggml tensor (its address); ``ne``/``nb`` read from it."""

    ptr: int

    @property
    def head(self) -> TensorHead:
        return TensorHead.from_address(self.ptr)

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(self.head.ne)

    @property
    def nb(self) -> tuple[int, ...]:
        return tuple(self.head.nb)

    @property
    def type(self) -> int:
        return int(self.head.type)

    def read(self, dims: int | None = None) -> np.ndarray:
        """Its values as numpy (``ne`` reversed; ``dims`` of them, by default as many as ggml counts:
        trailing 1s of ``ne`` dropped), read through its strides (a view need not be contiguous);
        F32, F16 and I32 only."""
        dtype = _NUMPY.get(self.type)
        if dtype is None:
            raise GGMLError(f"a tensor of ggml type {self.type} is not read out")
        ne, nb = self.ne, self.nb
        item = np.dtype(dtype).itemsize
        span = sum((n - 1) * b for n, b in zip(ne, nb)) + item
        L = lib()
        base = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(L.base.ggml_get_data(self.ptr)))
        view = np.lib.stride_tricks.as_strided(
            base.view(dtype), shape=tuple(reversed(ne)), strides=tuple(reversed(nb)), writeable=False
        )
        if dims is None:
            dims = max([1] + [i + 1 for i, n in enumerate(ne) if n != 1])
        return np.array(view, dtype=dtype).reshape(tuple(reversed(ne[:dims])))


@dataclass(frozen=True)
class Product:
    """A matrix product a graph made: the weight, its input, the expert ids (``mul_mat_id``), and the
    caller's mark of a product made a part at a time (see ``Graph.mul_mat``)."""

    weight: Tensor
    x: Tensor
    ids: Tensor | None = None
    part: int | None = None


class Graph:
    """One computation: its operations built with the methods below (each returns the new
    ``Tensor``) in a context that holds their descriptions only; ``compute`` places its inputs and
    intermediates with ggml's graph allocator (memory reused as tensors die, as llama.cpp's scheduler
    does; the tensors read afterwards, the products' inputs and what ``expand`` names, kept whole)
    and runs it on ``threads`` (the allocator and the work buffer: the ``arena``'s, reused by the next
    graph, or the graph's own). ``measure=True``: nothing computed; ``needed`` counts its tensors'
    bytes (an upper bound) and ``reserve()`` says what the allocator would take. Use as a context
    manager: its memory goes on exit."""

    MAX_NODES = 8192
    ALIGN = 16  # GGML_MEM_ALIGN: each tensor's memory is padded to it
    VIEWS = frozenset(f"ggml_{n}" for n in ("view_2d", "view_3d", "view_4d", "permute", "transpose",
                                            "reshape_2d", "reshape_3d", "reshape_4d"))  # fmt: skip

    def __init__(self, size: int = 0, threads: int = 1, measure: bool = False, arena: Arena | None = None):
        del size  # (the allocator sizes the graph's memory)
        self.measure = measure
        self._arena = arena if arena is not None else Arena()
        self._own_arena = arena is None
        self._ctx = _Context(0, self.MAX_NODES, self.MAX_NODES, no_alloc=True)
        self.threads = max(1, threads)
        self._L = lib().base
        self._graph = self._L.ggml_new_graph_custom(self._ctx.ptr, self.MAX_NODES, False)
        self.needed = 0  # bytes of the tensors made so far (views counted too: an upper bound)
        # every matrix product made: what llama-imatrix's callback is asked about; their inputs can
        # be read once the graph has run
        self.products: list[Product] = []
        self._fills: list[tuple[int, np.ndarray | None]] = []  # inputs: their values once placed
        self._view_of: dict[int, int] = {}  # a view -> the tensor it looks into
        self._kept: list[int] = []  # what is read after the graph ran

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.close()
        if self._own_arena:
            self._arena.close()

    # --- inputs ---
    def input(self, array: np.ndarray, type_id: int = F32) -> Tensor:
        """A new tensor holding ``array`` (numpy order: ``ne`` is its shape reversed)."""
        dtype = _NUMPY[type_id]
        a = np.ascontiguousarray(array, dtype=dtype)
        t = self._ctx.new(type_id, tuple(reversed(a.shape)) or (1,))
        self._L.ggml_set_input(t)
        self._count(t)
        self._fills.append((t, None if self.measure else a))
        return Tensor(t)

    def zeros(self, ne: tuple[int, ...], type_id: int = F32) -> Tensor:
        t = self._ctx.new(type_id, ne)
        self._L.ggml_set_input(t)
        self._count(t)
        self._fills.append((t, None))
        return Tensor(t)

    def _count(self, ptr: int) -> None:
        n = self._L.ggml_nbytes(ptr)
        self.needed += n + -n % self.ALIGN

    # --- operations ---
    def _op(self, name: str, *args: object) -> Tensor:
        call = getattr(self._L, name)
        ptr = call(self._ctx.ptr, *(a.ptr if isinstance(a, Tensor) else a for a in args))
        if not ptr:
            raise GGMLError(f"{name}: ggml made no tensor")
        if name in self.VIEWS and isinstance(args[0], Tensor):
            self._view_of[ptr] = args[0].ptr
        self._count(ptr)
        return Tensor(ptr)

    def _keep(self, t: Tensor | None) -> None:
        """``t`` (and what it is a view of) kept whole until the graph is gone: never reused."""
        ptr = t.ptr if t is not None else None
        while ptr is not None:
            self._L.ggml_set_output(ptr)
            ptr = self._view_of.get(ptr)

    def __getattr__(self, name: str) -> Callable[..., Tensor]:
        if f"ggml_{name}" not in _BASE or name in ("init", "free", "new_tensor", "get_data", "nbytes"):
            raise AttributeError(name)
        return lambda *args: self._op(f"ggml_{name}", *args)

    def mul_mat(self, a: Tensor, b: Tensor, part: int | None = None) -> Tensor:
        """``ggml_mul_mat(a, b)``; ``part``: the caller's mark for a product made a part at a time
        (a slice of the rows a runtime would multiply per sequence), kept with the product."""
        self.products.append(Product(a, b, None, part))
        return self._op("ggml_mul_mat", a, b)

    def mul_mat_id(self, a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        self.products.append(Product(a, b, ids, None))
        return self._op("ggml_mul_mat_id", a, b, ids)

    def set_n_kv_max(self, t: Tensor, n: int) -> None:
        self._L.ggml_flash_attn_ext_set_n_kv_max(t.ptr, n)

    def set_prec_f32(self, t: Tensor) -> None:
        self._L.ggml_prec_set_acc(t.ptr, PREC_F32)

    # --- running ---
    def expand(self, *tensors: Tensor) -> None:
        """Add these (and what they depend on) to the graph, in the order given; each is kept, to be
        read once the graph ran."""
        for t in tensors:
            self._keep(t)
            self._L.ggml_build_forward_expand(self._graph, t.ptr)

    def _place(self, reserve: bool = False) -> int:
        for p in self.products:  # (their inputs are read once the graph ran)
            self._keep(p.x)
            self._keep(p.ids)
        galloc = self._arena.allocator()
        ok = (self._L.ggml_gallocr_reserve if reserve else self._L.ggml_gallocr_alloc_graph)(
            galloc, self._graph
        )
        if not ok:
            raise GGMLError("ggml could not place the graph's tensors (out of memory?)")
        return int(self._L.ggml_gallocr_get_buffer_size(galloc, 0))

    def reserve(self) -> int:
        """The bytes ggml's allocator takes for this graph (built, not computed)."""
        return self._place(reserve=True)

    def compute(self) -> None:
        """Place the graph's tensors, fill its inputs, run it: ggml's plan, a work buffer of the size
        it asks, its threads."""
        if self.measure:
            raise GGMLError("a measured graph is not computed")
        self._place()
        for t, value in self._fills:
            if not self._L.ggml_get_data(t):  # (an input no operation reads: never placed)
                continue
            memory = _memory(t)
            if value is None:
                memory[:] = 0
            else:
                memory[:] = value.reshape(-1).view(np.uint8)
        cpu = lib().cpu
        plan = cpu.ggml_graph_plan(self._graph, self.threads, None)
        plan.work_data = self._arena.work(max(1, plan.work_size))
        if cpu.ggml_graph_compute(self._graph, ctypes.byref(plan)) != 0:
            raise GGMLError("ggml's computation failed")
