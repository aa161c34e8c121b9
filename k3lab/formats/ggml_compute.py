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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3lab.formats.ggml import TYPE_IDS, GGMLError
from k3lab.formats.ggml_lib import _BASE, TensorHead, _InitParams, lib

F32, F16, I32 = TYPE_IDS["F32"], TYPE_IDS["F16"], TYPE_IDS["I32"]
PREC_F32 = 10  # enum ggml_prec
_NUMPY = {F32: np.float32, F16: np.float16, I32: np.int32}


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
    graph, or the graph's own). ``measure=True``: nothing computed; ``reserve()`` says what the
    allocator would take. Use as a context manager: its memory goes on exit."""

    MAX_NODES = 8192
    VIEWS = frozenset(f"ggml_{n}" for n in ("view_2d", "view_3d", "view_4d", "permute", "transpose",
                                            "reshape_2d", "reshape_3d", "reshape_4d"))  # fmt: skip

    def __init__(self, threads: int = 1, measure: bool = False, arena: Arena | None = None):
        self.measure = measure
        self._arena = arena if arena is not None else Arena()
        self._own_arena = arena is None
        self._ctx = _Context(0, self.MAX_NODES, self.MAX_NODES, no_alloc=True)
        self.threads = max(1, threads)
        self._L = lib().base
        self._graph = self._L.ggml_new_graph_custom(self._ctx.ptr, self.MAX_NODES, False)
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
        self._fills.append((t, None if self.measure else a))
        return Tensor(t)

    def zeros(self, ne: tuple[int, ...], type_id: int = F32) -> Tensor:
        t = self._ctx.new(type_id, ne)
        self._L.ggml_set_input(t)
        self._fills.append((t, None))
        return Tensor(t)

    # --- operations ---
    def _op(self, name: str, *args: object) -> Tensor:
        call = getattr(self._L, name)
        ptr = call(self._ctx.ptr, *(a.ptr if isinstance(a, Tensor) else a for a in args))
        if not ptr:
            raise GGMLError(f"{name}: ggml made no tensor")
        if name in self.VIEWS and isinstance(args[0], Tensor):
            self._view_of[ptr] = args[0].ptr
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
