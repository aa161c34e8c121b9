"""Answers and headers bounded before they are parsed (#37): a Hub listing that is huge, gzip-bombed
or made of a million tiny objects, a stranger's MANIFEST.json of many small objects, JSON crafted
against a pattern, GGUF headers nested deep or of millions of keys, overlapping tensors, split keys
that lie about the set, and names carrying terminal escapes: each one line, in bounded memory (the
peak RSS of the process, measured by itself) and in time proportional to the bytes (a crafted input
that used to take minutes would time the subprocess out)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from hub_server import HubServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3lab.formats import gguf_header
from k3lab.formats.files import InputFileError, json_shape, parse_json

SET = "stranger/Kimi-K3-GGUF"
REPO = "moonshotai/Kimi-K3"
# the CLI in a process that says its own peak RSS (KiB) on its last stderr line: VmHWM, the peak of
# this very program (ru_maxrss would carry the forking test process's peak over the exec)
MEASURED = (
    "import re, sys\n"
    "from k3lab.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]\n"
    "print('rss', hwm, file=sys.stderr)\n"
    "sys.exit(code)\n"
)
RSS_BOUND = 600 << 10  # KiB: what a refused answer may cost the process at most


def _measured(env: dict[str, str], *args: str, timeout: float = 120) -> tuple[int, list[str], int]:
    """(exit code, stderr lines but the last, peak RSS in KiB)."""
    r = subprocess.run(
        [sys.executable, "-c", MEASURED, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("rss "), r.stderr
    return r.returncode, lines[:-1], int(lines[-1].split()[1])


# --- the Hub's answers --------------------------------------------------------------------------------


def _gzip_bomb(decoded: int) -> bytes:
    """A gzip body of ``decoded`` bytes of JSON (a list of spaces), made a MiB at a time (~1 MB)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    out = [z.compress(b"[")]
    space = b" " * (1 << 20)
    out += [z.compress(space) for _ in range(decoded >> 20)]
    return b"".join(out) + z.compress(b"]") + z.flush()


@pytest.mark.parametrize(
    "answer",
    ["objects", "gzip-bomb", "deep", "brotli"],
)
def test_a_hostile_listing_is_one_line_in_bounded_memory(tiny_src: Path, tmp_path: Path, answer: str) -> None:
    """The repo's listing (model_info) answered with 15 MB of tiny objects, with a gzip body that
    decodes to 1 GiB, nested 100,000 deep, or in an encoding k3lab does not decode."""
    if answer == "objects":
        body, headers = b"[" + b"{}," * (5 << 20) + b"{}]", {}
    elif answer == "gzip-bomb":
        body, headers = _gzip_bomb(1 << 30), {"Content-Encoding": "gzip"}
    elif answer == "deep":
        body, headers = b"[" * 100_000 + b"]" * 100_000, {}
    else:
        body, headers = b"\x0b\x00\x80", {"Content-Encoding": "br"}
    with HubServer(tiny_src) as hub:
        hub.info_answer = (body, headers)
        env = hub.client_env(tmp_path)
        code, err, rss = _measured(env, "plan", "--repo", REPO, "--meta", str(tmp_path / "meta"))
    assert code == 2 and len(err) == 1 and err[0].startswith("k3lab: error: "), err
    assert "/api/models/" in err[0] and "Traceback" not in err[0], err
    assert rss < RSS_BOUND, rss
    assert not (tmp_path / "meta").exists() or not list((tmp_path / "meta").iterdir())


def test_a_manifest_of_many_small_objects_is_one_line_in_bounded_memory(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "set"
    folder.mkdir()
    for p in tiny_out.glob("Kimi-K3-*.gguf"):
        shutil.copy(p, folder / p.name)
    (folder / "MANIFEST.json").write_bytes(
        b'{"format": "k3lab-manifest/3", "files": [' + b"{}," * (20 << 20) + b"{}]}"
    )
    with HubServer(tiny_src) as hub:
        hub.add_repo(SET, folder, large=None)
        code, err, rss = _measured(hub.client_env(tmp_path), "verify", SET)
    assert code in (1, 2) and len(err) == 1 and "MANIFEST.json" in err[0] and "objects" in err[0], err
    assert rss < RSS_BOUND, rss


def test_json_crafted_against_a_pattern_is_read_in_linear_time(tiny_src: Path, tmp_path: Path) -> None:
    """A shard header (and a manifest) of one unterminated string of escaped quotes: the old
    pattern for strings backtracked over every quote (25 s for 80 KB, quadratic); now one pass."""
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    shard = sorted(src.glob("*.safetensors"))[1]
    crafted = b'{"' + b'\\"' * 2_000_000
    shard.write_bytes(struct.pack("<Q", len(crafted)) + crafted)
    r = subprocess.run(
        [sys.executable, "-m", "k3lab.cli", "plan", "--meta", str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and shard.name in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(InputFileError, match="MANIFEST.json: not valid JSON"):
        parse_json(b'{"files": "' + b'\\"' * 2_000_000, "MANIFEST.json")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[],"\\ab:', max_size=60), st.sampled_from([1 << 20, 5, 1]))
def test_json_shape_counts_as_a_plain_scan_does(text: str, step: int) -> None:
    """The linear scan against a character-by-character reading of the same rule: a quote after an
        odd run of backslashes is not one (inside a string that is JSON's escape; outside one a backslash
        is invalid JSON, which json.loads refuses at that byte, so the counts up to it are exact). Scanned
        in steps of ``step`` bytes too: a string, a run of backslashes or a nesting carried from step to
        step, through both of the scan's ways (text with no backslash is first cut to its structural bytes,
    and a step with no backslash takes the quick one)."""
    import k3lab.formats.files as files

    depth = top = commas = objects = colons = 0
    inside = False
    backslashes = 0
    for ch in text:
        if ch == '"' and backslashes % 2 == 0:
            inside = not inside
        elif not inside and ch in "[{":
            depth += 1
            top = max(top, depth)
            objects += ch == "{"
        elif not inside and ch in "]}":
            depth -= 1
        elif not inside and ch == ",":
            commas += 1
        elif not inside and ch == ":":
            colons += 1
        backslashes = backslashes + 1 if ch == "\\" else 0
    real_step = files.SHAPE_STEP
    files.SHAPE_STEP = step
    try:
        assert files.json_counts(text.encode()) == (top, commas, objects, colons)
    finally:
        files.SHAPE_STEP = real_step


# --- GGUF headers ---------------------------------------------------------------------------------


def _gguf_prefix(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_arrays_nested_deep_are_refused_without_recursion() -> None:
    nested = _gguf_prefix(0, 1) + _key("a") + struct.pack("<I", 9)
    nested += struct.pack("<IQ", 9, 1) * 200_000 + struct.pack("<IQ", 0, 0)
    with pytest.raises(gguf_header.GGUFHeaderError, match="nested more than 8 deep"):
        gguf_header.parse(nested + b"\0" * 64, (), len(nested) + 64)


def test_a_header_of_millions_of_tiny_keys_is_refused_at_once() -> None:
    tiny = _gguf_prefix(0, 3_000_000) + (_key("k") + struct.pack("<IB", 0, 1)) * 1000
    with pytest.raises(gguf_header.GGUFHeaderError, match="3000000 keys: not a real header"):
        gguf_header.parse(tiny, (), None)


def test_a_vocabulary_of_millions_of_strings_is_walked_within_the_item_bound() -> None:
    n = gguf_header.MAX_ITEMS + 1
    strings = _gguf_prefix(0, 1) + _key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, n)
    with pytest.raises(gguf_header.GGUFHeaderError, match="strings and arrays inside arrays"):
        gguf_header.parse(strings + struct.pack("<Q", 0) * n, (), None)


def _write_set(folder: Path, names: list[str], split_count: int, tensor_names: list[list[str]]) -> None:
    """A split set as another tool writes it (gguf-py's writer): split keys as given."""
    total = sum(len(t) for t in tensor_names)
    for k, (name, tensors) in enumerate(zip(names, tensor_names)):
        w = gguf.GGUFWriter(folder / name, "kimi-k3")
        w.add_uint16("split.no", k)
        w.add_uint16("split.count", split_count)
        w.add_int32("split.tensors.count", total)
        for i, t in enumerate(tensors):
            w.add_tensor(t, np.full((4, 32), i + 10 * k, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def _verify(tiny_src: Path, tmp_path: Path, folder: Path) -> subprocess.CompletedProcess:
    from conftest import run_cli

    with HubServer(tiny_src) as hub:
        hub.add_repo(SET, folder, large=None)
        return run_cli(hub.client_env(tmp_path), "verify", SET, "--all")


def test_split_keys_that_lie_about_the_set_fail_verify(tiny_src: Path, tmp_path: Path) -> None:
    """Files 1 and 2 of a set named 3 files long, whose keys say 2: consistent with each other, not
    with their names (file 3 is missing)."""
    folder = tmp_path / "set"
    folder.mkdir()
    names = [f"Other-Q8_0-0000{k}-of-00003.gguf" for k in (1, 2)]
    _write_set(folder, names, 2, [["token_embd.weight"], ["output.weight"]])
    r = _verify(tiny_src, tmp_path, folder)
    assert r.returncode != 0 and "verify FAILED" in r.stdout, r.stdout + r.stderr
    assert "named file 1 of 3" in r.stdout, r.stdout


def test_overlapping_tensors_and_escapes_in_names(tiny_src: Path, tmp_path: Path) -> None:
    """The second tensor's offset moved onto the first's; its name carries a terminal escape: one
    line, the escape written out, never sent raw."""
    folder = tmp_path / "set"
    folder.mkdir()
    evil = "blk.0.attn_q\x1b[2J\rweight"
    _write_set(folder, ["Other-F32.gguf"], 1, [["token_embd.weight", evil]])
    path = folder / "Other-F32.gguf"
    data = bytearray(path.read_bytes())
    at = data.find(evil.encode()) + len(evil.encode())
    dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<Q", data, at + 4 + 8 * dims + 4, 0)  # its offset: the first tensor's
    path.write_bytes(bytes(data))
    with pytest.raises(gguf_header.GGUFHeaderError, match="overlap"):
        gguf_header.parse(bytes(data), (), len(data))
    r = _verify(tiny_src, tmp_path, folder)
    # (the file named as a problem of the set: a file that cannot be read stops no other's check)
    assert r.returncode == 1 and "\x1b" not in r.stdout + r.stderr and "\r" not in r.stdout, repr(r.stdout)
    (line,) = [ln for ln in r.stdout.splitlines() if "overlap" in ln]
    assert line.startswith("Other-F32.gguf: ") and "attn_q\\x1b[2J\\rweight" in line, line


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_mutation_of_a_header_is_parsed_or_refused(data, tmp_path_factory) -> None:
    """A real header (gguf-py's writer) cut, flipped and spliced anywhere: parsed into tensors that
    lie inside the file and apart, or refused as GGUFHeaderError, or more bytes asked for; nothing
    else. Bound per example: the parser touches each input byte a bounded number of times (items
    over ``MAX_ITEMS`` refused), here inputs under 4 KB."""
    folder = tmp_path_factory.mktemp("g")
    _write_set(folder, ["x.gguf"], 1, [["a.weight", "b.weight", "c.weight"]])
    base = bytearray((folder / "x.gguf").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(base) - 1))
        what = data.draw(st.sampled_from(["flip", "cut", "big"]))
        if what == "flip":
            base[at] ^= 1 << data.draw(st.integers(0, 7))
        elif what == "cut":
            del base[at:]
            if not base:
                base = bytearray(b"G")
        elif len(base) >= 8:
            value = data.draw(st.sampled_from([0, 2**63, 2**40, 7]))
            struct.pack_into("<Q", base, min(at, len(base) - 8), value)
    size = len(base)
    try:
        h = gguf_header.parse(bytes(base), ("split.count",), size)
    except (gguf_header.GGUFHeaderError, gguf_header.NeedMore):
        return
    spans = sorted((t.offset, t.offset + t.nbytes) for t in h.tensors)
    assert all(0 <= a <= b <= size for a, b in spans)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))


def test_the_listing_shape_limits_leave_room_for_kimi_k3(tmp_path: Path) -> None:
    """The bounds are far above the real thing: a listing of Kimi-K3's 100 files, a manifest of a
    million source entries, parse."""
    siblings = [
        {"rfilename": f"model-{k:05d}-of-000096.safetensors", "size": 1, "lfs": {"sha256": "0" * 64}}
        for k in range(1, 97)
    ]
    assert json_shape(json.dumps({"siblings": siblings}).encode())[2] < 1000
    entries = {"files": [{"sources": [{"name": f"t{i}", "file": "f"} for i in range(1_000_000)]}]}
    assert len(parse_json(json.dumps(entries).encode(), "MANIFEST.json")["files"][0]["sources"]) == 1_000_000


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (
            '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            "tensor a: appears twice",
        ),
        (
            '{"a":{"dtype":"F32","dtype":"U8","shape":[1],"data_offsets":[0,4]}}',
            "tensor dtype: appears twice",
        ),
        (
            '{"__metadata__":{"k":"v","k":"w"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
            "tensor k: appears twice",
        ),
        ('{"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', None),
        ('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"y":1}}}', None),
    ],
)
def test_a_header_naming_a_key_twice_is_refused(text: str, found: str | None) -> None:
    """A key named twice would silently keep its last value (as the safetensors library refuses it):
    found whatever the level, while a header without one parses (nested objects included)."""
    from k3lab.formats.safetensors import SafetensorsError, parse_header

    raw = text.encode()
    if found is None:
        entries, _ = parse_header(raw, "m.safetensors", 8 + len(raw) + 8)
        assert list(entries) == ["a"]
        return
    with pytest.raises(SafetensorsError, match=re.escape(f"m.safetensors: {found} in the header")):
        parse_header(raw, "m.safetensors", 8 + len(raw) + 8)
