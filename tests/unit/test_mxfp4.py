"""The MXFP4 repack: golden bytes, bit-exact against gguf-py's dequantiser, properties, errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from k3lab.formats import mxfp4

MXFP4 = gguf.GGMLQuantizationType.MXFP4

# One hand-worked block: element i has code i for i < 16 and code 31-i after (0..15, 15..0).
GOLDEN_PACKED = bytes.fromhex("10325476 98badcfe efcdab89 67452301".replace(" ", ""))
GOLDEN_SCALE = 0x7F  # 2**0
GOLDEN_GGML = bytes.fromhex("7f f0e1d2c3b4a59687 78695a4b3c2d1e0f".replace(" ", ""))


def _dequant(blocks: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return dequantize(blocks, MXFP4)


def test_golden_block_bytes() -> None:
    packed = np.frombuffer(GOLDEN_PACKED, dtype=np.uint8).reshape(1, 16)
    scale = np.array([[GOLDEN_SCALE]], dtype=np.uint8)
    assert mxfp4.repack(packed, scale).tobytes() == GOLDEN_GGML
    assert mxfp4.repack_unpack_stack(packed, scale).tobytes() == GOLDEN_GGML


def test_golden_block_values() -> None:
    packed = np.frombuffer(GOLDEN_PACKED, dtype=np.uint8).reshape(1, 16)
    scale = np.array([[GOLDEN_SCALE]], dtype=np.uint8)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    codes = list(range(16)) + list(range(15, -1, -1))
    expected = [(-1 if c & 8 else 1) * e2m1[c & 7] for c in codes]
    np.testing.assert_array_equal(mxfp4.decode_compressed_tensors(packed, scale)[0], expected)
    np.testing.assert_array_equal(_dequant(np.frombuffer(GOLDEN_GGML, np.uint8).reshape(1, 17))[0], expected)


def test_every_scale_byte_and_code_matches_gguf_dequantize() -> None:
    rng = np.random.default_rng(7)
    rows, cols = 256, 256
    codes = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    codes[:, :16] = np.arange(16, dtype=np.uint8)  # every code in every row
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], cols // 32, axis=1)  # every E8M0 byte
    ggml_bytes = mxfp4.repack(packed, scale)
    ref = mxfp4.decode_compressed_tensors(packed, scale)
    got = _dequant(ggml_bytes)
    assert got.shape == ref.shape == (rows, cols)
    assert np.array_equal(got, ref, equal_nan=True)
    assert np.array_equal(mxfp4.decode_ggml(ggml_bytes, cols), ref, equal_nan=True)
    # the extremes are really exercised: a subnormal, the largest finite value, and overflow
    assert ref[0, 1] == np.float32(2.0**-128)  # code 1 (0.5) at e=0
    assert ref[252, 7] == np.float32(1.5 * 2.0**127)  # code 7 (6.0) at e=252: the largest finite
    assert ref[255, 1] == np.float32(2.0**127)  # 0.5 * 2**128 is still finite
    assert np.isinf(ref[253, 7])  # 6 * 2**126 overflows float32


def test_stack_of_experts_decodes_per_expert() -> None:
    rng = np.random.default_rng(1)
    pairs = [
        (rng.integers(0, 256, (64, 48), dtype=np.uint8), rng.integers(110, 130, (64, 3), dtype=np.uint8))
        for _ in range(5)
    ]
    stacked = mxfp4.repack_experts(pairs)
    assert stacked.shape == (5, 64, 3 * 17)
    got = _dequant(stacked)
    for e, (p, s) in enumerate(pairs):
        np.testing.assert_array_equal(got[e], mxfp4.decode_compressed_tensors(p, s))


def test_repack_into_a_callers_buffer() -> None:
    rng = np.random.default_rng(2)
    p, s = rng.integers(0, 256, (8, 32), dtype=np.uint8), rng.integers(0, 256, (8, 2), dtype=np.uint8)
    buf = bytearray(8 * 2 * 17)
    mxfp4.repack_into(p, s, memoryview(buf))
    assert bytes(buf) == mxfp4.repack_unpack_stack(p, s).tobytes()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 6), seed=st.integers(0, 2**32 - 1))
def test_three_implementations_agree(rows: int, blocks: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 256, (rows, blocks * 16), dtype=np.uint8)
    s = rng.integers(0, 256, (rows, blocks), dtype=np.uint8)
    fast = mxfp4.repack(p, s)
    simple = mxfp4.repack_unpack_stack(p, s)
    vectorised = np.empty_like(fast)
    mxfp4._repack_numpy(p, s, vectorised)
    assert fast.tobytes() == simple.tobytes() == vectorised.tobytes()
    assert np.array_equal(_dequant(fast), mxfp4.decode_compressed_tensors(p, s), equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=32, max_size=32))
def test_quantize_then_decode_is_on_the_e2m1_grid(values: list[float]) -> None:
    w = np.array(values, dtype=np.float32).reshape(1, 32)
    p, s = mxfp4.quantize_compressed_tensors(w)
    d = mxfp4.decode_compressed_tensors(p, s)
    step = np.ldexp(1.0, int(s[0, 0]) - 127)
    assert set(np.abs(d[0] / step).tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    assert np.abs(d).max() <= max(np.abs(w).max() * 1.5, step * 6)


@pytest.mark.parametrize(
    ("packed", "scale", "message"),
    [
        (np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8), "16 columns is not a multiple of 32"),
        (
            np.zeros((4, 16), np.uint8),
            np.zeros((4, 2), np.uint8),
            r"weight_scale shape \(4, 2\) does not match",
        ),
        (np.zeros((4, 16), np.uint8), np.zeros((4, 1), np.float32), "weight_scale must be uint8"),
        (np.zeros((4, 16), np.int8), np.zeros((4, 1), np.uint8), "weight_packed must be uint8"),
        (np.zeros((4, 4, 4), np.uint8), np.zeros((4, 1), np.uint8), "must be 2-D"),
    ],
)
def test_bad_shapes_are_clear_errors(packed: np.ndarray, scale: np.ndarray, message: str) -> None:
    with pytest.raises(mxfp4.MXFP4ShapeError, match=message):
        mxfp4.repack(packed, scale, what="blk.1.ffn_up_exps")


def test_output_buffer_size_is_checked() -> None:
    with pytest.raises(mxfp4.MXFP4ShapeError, match="output buffer has 10 bytes, MXFP4 needs 17"):
        mxfp4.repack_into(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint8), np.zeros(10, np.uint8))
