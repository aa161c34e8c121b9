"""Bad input: a one-line error naming the file and tensor, exit code 2, nothing at a final path."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_edits import read_tensors, write_tensors

from k3lab.cli import main

LAYER2 = "model-00003-of-000011.safetensors"  # holds layer 2
EXP = "language_model.model.layers.2.block_sparse_moe.experts."


def _retype(name: str, dtype: str, shape: tuple[int, ...] | None = None) -> Callable[[Path], None]:
    def edit(src: Path) -> None:
        ts = read_tensors(src / LAYER2)
        for t in ts:
            if t[0] == name:
                t[1], t[2] = dtype, shape or t[2]
        write_tensors(src / LAYER2, ts)

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
    ts = [t for t in read_tensors(src / LAYER2) if not t[0].startswith(EXP + "5.w2.")]
    write_tensors(src / LAYER2, ts)
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
    ts = read_tensors(src / LAYER2)
    ts.append(["language_model.model.layers.2.self_attn.mystery.weight", "BF16", (4,), b"\0" * 8])
    write_tensors(src / LAYER2, ts)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["language_model.model.layers.2.self_attn.mystery.weight"] = LAYER2
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        cfg = json.loads((src / "config.json").read_text())
        edit(cfg)
        (src / "config.json").write_text(json.dumps(cfg))

    return apply


def _text(key: str, value: object) -> Callable[[Path], None]:
    return _config(lambda c: c["text_config"].__setitem__(key, value))


def _lac(key: str, value: object) -> Callable[[Path], None]:
    return _config(lambda c: c["text_config"]["linear_attn_config"].__setitem__(key, value))


def _json_file(name: str, value: object) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        (src / name).write_text(json.dumps(value))

    return apply


def _tok_cfg(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(src: Path) -> None:
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        edit(cfg)
        (src / "tokenizer_config.json").write_text(json.dumps(cfg))

    return apply


def _header(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rewrite LAYER2's header JSON as another writer might have, keeping its data."""

    def apply(src: Path) -> None:
        p = src / LAYER2
        raw = p.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + n])
        edit(header)
        new = json.dumps(header).encode()
        new += b" " * (-len(new) % 8)
        p.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])

    return apply


def _first_tensor(h: dict) -> dict:
    return h[sorted(k for k in h if k != "__metadata__")[0]]


def _deep_header(src: Path) -> None:
    p = src / LAYER2
    raw = b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw)


def _fifo_shard(src: Path) -> None:
    (src / LAYER2).unlink()
    os.mkfifo(src / LAYER2)


def _dir_shard(src: Path) -> None:
    (src / LAYER2).unlink()
    (src / LAYER2).mkdir()


def _bad_tiktoken_line(src: Path) -> None:
    lines = (src / "tiktoken.model").read_bytes().splitlines()
    lines[300] = b"@@not-base64@@ 300"
    (src / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")


def _weight_map_list(src: Path) -> None:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] = list(index["weight_map"].items())
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


TC = "config.json"
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
    "the last expert's weight_packed of the wrong dtype": (  # (a stack is checked a column at a time)
        _retype(EXP + "7.w3.weight_packed", "I8"),
        [LAYER2, EXP + "7.w3.weight_packed", "I8", "expected U8"],
    ),
    "a missing expert": (_missing_expert, [LAYER2, EXP + "5.w2.weight_packed", "missing"]),
    "index names a missing file": (_index_names_missing_file, ["model.safetensors.index.json", LAYER2]),
    "config lacks a required key": (_config_lacks_key, ["config.json", "kv_lora_rank"]),
    "a tensor no rule covers": (_unused_tensor, [LAYER2, "self_attn.mystery.weight", "not used by any rule"]),
    # config values of the wrong type, out of range, or inconsistent
    "max_position_embeddings as a string": (
        _text("max_position_embeddings", "4096"),
        [TC, "max_position_embeddings", '"4096"', "positive integer"],
    ),
    "rms_norm_eps as a string": (_text("rms_norm_eps", "1e-6"), [TC, "rms_norm_eps", "positive number"]),
    "negative hidden_size": (_text("hidden_size", -128), [TC, "hidden_size is -128"]),
    "hidden_size 0": (_text("hidden_size", 0), [TC, "hidden_size is 0"]),
    "num_hidden_layers not a number": (_text("num_hidden_layers", "abc"), [TC, "num_hidden_layers"]),
    "num_experts 0": (_text("num_experts", 0), [TC, "num_experts is 0"]),
    "negative top-k": (_text("num_experts_per_token", -1), [TC, "num_experts_per_token is -1"]),
    "top-k above experts": (
        _text("num_experts_per_token", 9),
        [TC, "num_experts_per_token 9 exceeds num_experts"],
    ),
    "a bool where a count goes": (_text("num_shared_experts", True), [TC, "num_shared_experts is true"]),
    "heads not dividing": (_text("num_key_value_heads", 3), [TC, "not a multiple of num_key_value_heads 3"]),
    "quantization_config a string": (
        _text("quantization_config", "mxfp4"),
        [TC, "quantization_config", "expected an object"],
    ),
    "quantization_config of another format": (
        _config(
            lambda c: c["text_config"]["quantization_config"].__setitem__("format", "nvfp4-pack-quantized")
        ),
        [TC, "nvfp4-pack-quantized", "compressed-tensors/mxfp4-pack-quantized"],
    ),
    "top-level quantization_config of another method": (
        _config(lambda c: c.__setitem__("quantization_config", {"quant_method": "fp8", "format": "float"})),
        [TC, "quantization_config is fp8/float"],
    ),
    "4-bit groups of 16": (
        _config(
            lambda c: c["text_config"]["quantization_config"]["config_groups"]["group_0"][
                "weights"
            ].__setitem__("group_size", 16)
        ),
        [TC, "group_size is 16", "MXFP4 needs 32"],
    ),
    "linear_attn_config a number": (_text("linear_attn_config", 5), [TC, "linear_attn_config is 5"]),
    "KDA head_dim 0": (_lac("head_dim", 0), [TC, "linear_attn_config.head_dim is 0"]),
    "full_attn_layers out of range": (_lac("full_attn_layers", [4, 99]), [TC, "99 outside 1..8"]),
    "config not an object": (_json_file("config.json", [1, 2]), [TC, "not a JSON object"]),
    # tokenizer files (checked at plan time, before file 2..N are written)
    "tokenizer_config a list": (
        _json_file("tokenizer_config.json", []),
        ["tokenizer_config.json", "not a JSON object"],
    ),
    "added_tokens_decoder a list": (
        _tok_cfg(lambda c: c.__setitem__("added_tokens_decoder", [])),
        ["tokenizer_config.json", "added_tokens_decoder is not an object"],
    ),
    "bad base64 in tiktoken.model": (_bad_tiktoken_line, ["tiktoken.model:301", "bad base64"]),
    # the index and the headers
    "weight_map a list": (_weight_map_list, ["model.safetensors.index.json", "not a safetensors index"]),
    "data_offsets as floats": (
        _header(
            lambda h: _first_tensor(h).__setitem__(
                "data_offsets", [float(x) for x in _first_tensor(h)["data_offsets"]]
            )
        ),
        [LAYER2, "bad shape", "offsets"],
    ),
    "a shape holding true": (
        _header(lambda h: _first_tensor(h).__setitem__("shape", [True] + _first_tensor(h)["shape"][1:])),
        [LAYER2, "bad shape"],
    ),
    "a header nested 200k levels deep": (_deep_header, [LAYER2, "nests 200001 levels"]),
    "a FIFO as a shard": (_fifo_shard, [LAYER2, "is a FIFO"]),
    "a directory as a shard": (_dir_shard, [LAYER2, "is a directory"]),
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
    assert err.startswith("k3lab: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()  # found before anything was written: not even the folder
    # fixed, the same command runs clean
    shutil.rmtree(src)
    shutil.copytree(tiny_src, src)
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]) == 0
    assert len(list(out.glob("*.gguf"))) == 1 and not list(out.rglob("*.partial"))


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
