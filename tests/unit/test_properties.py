"""Property-based checks (hypothesis) over what users, files and servers give k3lab: CLI numbers, and
the values of a safetensors header, a config and a manifest. Every input either works or fails with
one line (exit 2, or 1 for a set that does not verify), never a traceback, and within a bound per
input: ``SECONDS`` of wall time and ``PEAK`` bytes of Python allocations (tracemalloc, which
numpy's arrays report to as well)."""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from k3lab.cli import main
from k3lab.formats.safetensors import SafetensorsError, _entries_one_by_one, _sound_entries, parse_header

SECONDS = 20.0
PEAK = 256 << 20
PROPERTY = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], database=None
)

# any JSON value, including the awkward ones: huge and negative integers, non-finite floats,
# deep lists, strings of digits
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


def _bounded(
    capsys: pytest.CaptureFixture[str], argv: list[str], codes: tuple[int, ...]
) -> tuple[int, list[str]]:
    """``main(argv)``, within the time and memory bound; one line when it fails."""
    capsys.readouterr()
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        code = main(argv)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    took = time.monotonic() - t0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert took < SECONDS and peak < PEAK, (argv, took, peak)
    assert code in codes, (argv, code, captured.err)
    errors = captured.err.strip().splitlines()
    if code == 2:
        assert len(errors) == 1 and errors[0].startswith("k3lab: error: "), (argv, errors)
    return code, (captured.err + captured.out).strip().splitlines()


@pytest.fixture(scope="module")
def complete(tiny_out: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("complete") / "out"
    shutil.copytree(tiny_out, out)
    return out


NUMBER_TEXT = st.one_of(
    st.integers(min_value=-(10**12), max_value=10**12).map(str),
    st.floats().map(repr),
    st.text(alphabet="0123456789-+,. e\u0663\uff11abc", max_size=12),
)


@PROPERTY
@given(
    flag=st.sampled_from(["--files", "--shards", "--jobs", "--retry-budget", "--name", "--commit-every"]),
    value=NUMBER_TEXT,
)
def test_cli_numbers_convert_or_fail_in_one_line(
    tiny_src: Path, complete: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    extra = [flag, value]
    if flag == "--retry-budget":
        extra = ["--repo", "org/none", "--src", str(tiny_src), *extra]  # (refused before the network: exit 2)
    code, lines = _bounded(
        capsys, ["convert", "--meta", str(tiny_src), "--out-dir", str(complete), "--quiet", *extra], (0, 2)
    )
    if code == 2 and flag != "--retry-budget":
        said = "--files" if flag == "--shards" else flag  # (--shards is --files' earlier name)
        assert said in lines[0] or "--push-to" in lines[0], lines


@st.composite
def headers(draw: Any) -> bytes:
    """A safetensors header: mostly well-formed entries, each field sometimes any JSON value."""
    entries = {}
    for i in range(draw(st.integers(0, 4))):
        entry: dict[str, Any] = {
            "dtype": draw(st.sampled_from(["BF16", "U8", "F32", "XX"]) | JSON),
            "shape": draw(st.lists(st.integers(-3, 2**40), max_size=4) | JSON),
            "data_offsets": draw(st.lists(st.integers(-3, 2**40), min_size=2, max_size=2) | JSON),
        }
        entries[draw(st.text(max_size=10)) + str(i)] = entry
    if draw(st.booleans()):
        entries["__metadata__"] = draw(JSON)
    return json.dumps(entries).encode()


@PROPERTY
@given(raw=headers(), size=st.integers(0, 2**42))
# (found by this property: a name holding a newline made a two-line error)
@example(raw=b'{"\\n0": {"dtype": "BF16", "shape": [], "data_offsets": [0, 0]}}', size=0)
@example(raw=b'{"a\\n": {}, "a\\n": {}}', size=0)
def test_header_values_parse_or_fail_in_one_line(raw: bytes, size: int) -> None:
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        parse_header(raw, "model-00001-of-00002.safetensors", size)
    except SafetensorsError as e:
        assert "\n" not in str(e) and str(e).startswith("model-00001-of-00002.safetensors: "), str(e)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.monotonic() - t0 < SECONDS and peak < PEAK


@PROPERTY
@given(raw=headers(), size=st.integers(0, 2**42))
@example(
    raw=b'{"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}, "b": {"dtype": "U8", "shape": [], "data_offsets": [12, 13]}}',
    size=200,
)
@example(raw=b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2, 5]}}', size=64)
@example(raw=b'{"a": {"dtype": "U8", "shape": [-2, -1], "data_offsets": [0, 2]}}', size=200)
@example(raw=b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', size=12)
@example(raw=b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": "02"}}', size=64)
@example(raw=b'{"a": {"dtype": "U8", "shape": [true, 2], "data_offsets": [0, 2]}}', size=200)
def test_a_header_checked_a_column_at_a_time_is_the_one_checked_entry_by_entry(raw: bytes, size: int) -> None:
    """The fast check (columns at C speed) accepts only headers the entry-by-entry check accepts, and
    makes the same entries; what it turns down, the slow check decides and names."""
    header = json.loads(raw)
    header.pop("__metadata__", None)
    data_start, file = 8 + len(raw), "model-00001-of-00002.safetensors"
    fast = _sound_entries(header, file, data_start, size - data_start)
    if fast is not None:
        assert fast == _entries_one_by_one(header, file, data_start, size - data_start)
        assert [type(d) for e in fast.values() for d in e.shape] == [
            int for e in fast.values() for _ in e.shape
        ]


TEXT_KEYS = [
    "num_hidden_layers",
    "num_experts",
    "num_experts_per_token",
    "hidden_size",
    "vocab_size",
    "first_k_dense_replace",
    "moe_intermediate_size",
    "kv_lora_rank",
    "rms_norm_eps",
    "attn_res_block_size",
    "linear_attn_config.full_attn_layers",
    "linear_attn_config.kda_layers",
    "linear_attn_config.num_heads",
    "quantization_config.config_groups",
]


@pytest.fixture(scope="module")
def meta_copy(tiny_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    meta = tmp_path_factory.mktemp("meta")
    for p in tiny_src.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copy(p, meta / p.name)
    return meta


@PROPERTY
@given(key=st.sampled_from(TEXT_KEYS), value=JSON | st.integers(min_value=2**31, max_value=2**64))
def test_config_values_plan_or_fail_in_one_line(
    tiny_src: Path, meta_copy: Path, capsys: pytest.CaptureFixture[str], key: str, value: Any
) -> None:
    cfg = json.loads((tiny_src / "config.json").read_text())
    node = cfg["text_config"]
    *parents, last = key.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    try:
        (meta_copy / "config.json").write_text(json.dumps(cfg))
    except ValueError:  # (a float json cannot write): nothing to check
        return
    code, lines = _bounded(
        capsys, ["plan", "--meta", str(meta_copy), "--src", str(tiny_src), "--json"], (0, 2)
    )
    if code == 2:
        assert "config.json" in lines[0] or ".safetensors" in lines[0] or "tiktoken" in lines[0], lines


RECORD_FIELDS = ["size", "data_start", "number", "split_count", "split_tensors", "tensors", "header_sha256"]
TENSOR_FIELDS = ["offset", "nbytes", "ne", "sha256", "name", "type"]


@PROPERTY
@given(
    record=st.integers(0, 10),
    field=st.sampled_from(RECORD_FIELDS + [f"tensors.{f}" for f in TENSOR_FIELDS]),
    value=JSON | st.integers(min_value=2**31, max_value=2**64),
)
def test_manifest_values_verify_or_fail_in_a_few_lines(
    tiny_out: Path,
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    record: int,
    field: str,
    value: Any,
) -> None:
    out = tmp_path_factory.mktemp("m")
    for p in tiny_out.glob("*.gguf"):
        shutil.copy(p, out / p.name)
    man = json.loads((tiny_out / "MANIFEST.json").read_text())
    rec = man["files"][record % len(man["files"])]
    if field.startswith("tensors."):
        if rec["tensors"]:
            rec["tensors"][0][field.split(".", 1)[1]] = value
    else:
        rec[field] = value
    try:
        (out / "MANIFEST.json").write_text(json.dumps(man))
    except ValueError:
        return
    code, lines = _bounded(capsys, ["verify", str(out), "--quiet"], (0, 1))
    assert len(lines) <= 6, lines
    shutil.rmtree(out)


@settings(max_examples=300, deadline=None, database=None)
@given(
    head=st.sampled_from(["", "language_model.model.layers.", "language_model.model.", "vision_tower."]),
    rest=st.text(alphabet="layers.0123456789\u0663x", max_size=24),
)
@example(head="language_model.model.layers.", rest="x.layers.3.a")
@example(head="language_model.model.layers.", rest="\u0663.a")
def test_a_layer_number_cut_from_a_text_name_is_the_one_the_pattern_finds(head: str, rest: str) -> None:
    """``layer_of``'s quick cut of the text model's names gives what its pattern (the first
    ``layers.N.`` at the start or after a dot) gives, for any name."""
    from k3lab.kimi_k3.rules import _LAYER, layer_of

    name = head + rest
    m = _LAYER.search(name)
    assert layer_of(name) == (int(m.group(1)) if m else None)
