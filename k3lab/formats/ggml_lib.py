"""ggml's C functions as ctypes calls them: libggml-base and libggml-cpu of llama-cpp-python (the one
copy llama.cpp's own libraries link), each function's arguments and result declared once (``lib()``),
the structures read and written (a context's parameters, a tensor's first fields, a compute plan), and
ggml's logger silenced where it would print a line per tensor. For ``ggml_compute`` and
``ggml_weights``."""

from __future__ import annotations

import ctypes
import functools

from k3lab.formats.ggml import GGMLError, library_path


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
