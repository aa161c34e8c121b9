"""Bad input: a one-line error naming the file and tensor, exit code 2, nothing at a final path."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from k3lab.cli import main
from k3lab.formats.safetensors import build_header

LAYER2 = "model-00003-of-00011.safetensors"  # holds layer 2
EXP = "language_model.model.layers.2.block_sparse_moe.experts."


def _tensors(path: Path) -> list[list]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = []
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = info["data_offsets"]
        out.append([name, info["dtype"], tuple(info["shape"]), raw[8 + n + a : 8 + n + b]])
    return out


def _write(path: Path, tensors: list[list]) -> None:
    path.write_bytes(build_header([(n, d, s) for n, d, s, _ in tensors]) + b"".join(t[3] for t in tensors))


def _retype(name: str, dtype: str, shape: tuple[int, ...] | None = None) -> Callable[[Path], None]:
    def edit(src: Path) -> None:
        ts = _tensors(src / LAYER2)
        for t in ts:
            if t[0] == name:
                t[1], t[2] = dtype, shape or t[2]
        _write(src / LAYER2, ts)

    return edit


def _truncate(src: Path) -> None:
    p = src / LAYER2
    p.write_bytes(p.read_bytes()[:-1000])


def _offsets_past_end(src: Path) -> None:
    p = src / LAYER2
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    a, b = header[last]["data_offsets"]
    header[last]["data_offsets"] = [a + 4096, b + 4096]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    p.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _missing_expert(src: Path) -> None:
    ts = [t for t in _tensors(src / LAYER2) if not t[0].startswith(EXP + "5.w2.")]
    _write(src / LAYER2, ts)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(EXP + "5.w2.")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_names_missing_file(src: Path) -> None:
    (src / LAYER2).unlink()


def _config_lacks_key(src: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["kv_lora_rank"]
    (src / "config.json").write_text(json.dumps(cfg))


def _unused_tensor(src: Path) -> None:
    ts = _tensors(src / LAYER2)
    ts.append(["language_model.model.layers.2.self_attn.mystery.weight", "BF16", (4,), b"\0" * 8])
    _write(src / LAYER2, ts)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.model.layers.2.self_attn.mystery.weight"] = LAYER2
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


CASES = {
    "truncated shard": (_truncate, [LAYER2, "past the end of the file"]),
    "header offsets past end of file": (_offsets_past_end, [LAYER2, "past the end of the file", "layers.2."]),
    "weight_packed of the wrong dtype": (
        _retype(EXP + "3.w1.weight_packed", "I8"),
        [LAYER2, EXP + "3.w1.weight_packed", "I8", "expected U8"],
    ),
    "weight_scale of the wrong shape": (
        _retype(EXP + "0.w2.weight_scale", "U8", (48, 4)),
        [LAYER2, EXP + "0.w2.weight_scale", "[48, 4]", "expected U8 [96, 2]"],
    ),
    "a missing expert": (_missing_expert, [LAYER2, EXP + "5.w2.weight_packed", "missing"]),
    "index names a missing file": (_index_names_missing_file, ["model.safetensors.index.json", LAYER2]),
    "config lacks a required key": (_config_lacks_key, ["config.json", "kv_lora_rank"]),
    "a tensor no rule covers": (_unused_tensor, [LAYER2, "self_attn.mystery.weight", "not used by any rule"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_clear_line(
    case: str, tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    edit, needles = CASES[case]
    edit(src)
    out = tmp_path / "out"
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet", "--jobs", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("k3lab: error: ")
    for needle in needles:
        assert needle in err, (needle, err)
    assert not list(out.glob("*.gguf")) and not list(out.glob("*.partial"))


def test_user_files_are_never_touched(tiny_src: Path, tmp_path: Path) -> None:
    """A failing conversion leaves the source and unrelated files in the output folder alone."""
    src = tmp_path / "src"
    shutil.copytree(tiny_src, src)
    _truncate(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]) == 2
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert (out / "notes.txt").read_text() == "mine"


def test_an_unusable_output_folder_is_one_line(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "out"
    blocker.write_text("a file where the output folder should be")
    assert main(["convert", "--meta", str(tiny_src), "--out-dir", str(blocker), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3lab: error:") and str(blocker) in err[0]
    assert blocker.read_text().startswith("a file")  # the user's file is untouched
