"""The text converter: every tensor re-derived from the source bit for bit; llama.cpp runs the set;
any order, parallel or killed-and-resumed runs give byte-identical files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import PER_LAYER, convert
from gguf.quants import dequantize
from judges import Source, expected_tensor
from llama_support import needs_llama

from k3lab.cli import main

LM = "language_model.model."
N_FILES = 9  # 8 layers + the output shard


def _files(out: Path) -> list[Path]:
    return sorted(out.glob("Kimi-K3-MXFP4-*-of-00009.gguf"))


def test_every_tensor_is_the_source_under_its_transform(tiny_src: Path, tiny_out: Path) -> None:
    src = Source(tiny_src)
    cfg = json.loads((tiny_src / "config.json").read_text())
    seen = 0
    for path in _files(tiny_out):
        for t in gguf.GGUFReader(path).tensors:
            gtype, want = expected_tensor(src, t.name, cfg)
            assert t.tensor_type.name == gtype, t.name
            if gtype == "BF16":  # the very bits
                got = t.data.view(np.uint16).reshape(want.shape)
                assert np.array_equal(got, want), t.name
            elif gtype == "MXFP4":  # gguf-py's own dequantiser vs the compressed-tensors definition
                got = dequantize(t.data, gguf.GGMLQuantizationType.MXFP4)
                assert np.array_equal(got, want), t.name
            else:
                assert np.array_equal(
                    np.asarray(t.data).reshape(want.shape).view(np.uint32),
                    np.ascontiguousarray(want, dtype=np.float32).view(np.uint32),
                ), t.name
            seen += 1
    assert seen == 218


def test_split_set_keys(tiny_out: Path) -> None:
    files = _files(tiny_out)
    assert len(files) == N_FILES
    counts = 0
    for i, path in enumerate(files):
        r = gguf.GGUFReader(path)
        assert r.fields["split.no"].contents() == i
        assert r.fields["split.count"].contents() == N_FILES
        assert r.fields["split.tensors.count"].contents() == 218
        assert ("tokenizer.ggml.tokens" in r.fields) == (i == 0)
        assert ("kimi-k3.block_count" in r.fields) == (i == 0)
        counts += len(r.tensors)
    assert counts == 218
    first = gguf.GGUFReader(files[0])
    assert first.fields["general.file_type"].contents() == 38


@needs_llama
def test_llama_cpp_loads_the_set_and_generates_deterministically(tiny_out: Path) -> None:
    import llama_cpp

    def generate() -> list[int]:
        llm = llama_cpp.Llama(
            str(_files(tiny_out)[0]), n_ctx=128, n_threads=2, verbose=False, seed=0, logits_all=True
        )
        llm.eval(llm.tokenize(b"The quick brown fox", add_bos=False))
        out = []
        for _ in range(16):
            tok = llm.sample(top_k=1, temp=0.0)
            out.append(tok)
            llm.eval([tok])
        logits = np.array(llm.scores[llm.n_tokens - 1])
        assert np.isfinite(logits).all() and logits.std() > 0
        return out

    first = generate()
    assert len(first) == 16 and len(set(first)) > 1
    assert generate() == first


def test_any_order_one_at_a_time_gives_identical_files(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    for k in [9, 3, 1, 7, 2, 8, 5, 4, 6]:
        assert convert(tiny_src, tmp_path, "--shards", str(k)) == 0
    for a, b in zip(_files(tiny_out), _files(tmp_path), strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name
    assert json.loads((tmp_path / "MANIFEST.json").read_text()) == json.loads(
        (tiny_out / "MANIFEST.json").read_text()
    )


def test_conversions_in_threads_of_one_process_give_identical_files(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """A Dask worker with several threads runs several conversions in one process: each must
    wait for its own background hashes only, and the set must come out the same."""
    from concurrent.futures import ThreadPoolExecutor

    from conftest import saved_plan

    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.running.task import Task, run_task
    from k3lab.pipeline.sources.base import SourceSpec
    from k3lab.pipeline.state import OutputFolder

    spec = SourceSpec.local(tiny_src)
    task = Task(MODEL, str(tmp_path), spec, saved_plan(tiny_src, tmp_path).inputs_digest)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda k: run_task(task, k), range(1, 10)))
    assert sorted(r.number for r in results) == list(range(1, 10))
    OutputFolder(tmp_path).records.merge()
    for a, b in zip(_files(tiny_out), _files(tmp_path), strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name
    assert json.loads((tmp_path / "MANIFEST.json").read_text()) == json.loads(
        (tiny_out / "MANIFEST.json").read_text()
    )


def test_rerun_skips_complete_files_and_redoes_damaged_ones(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert convert(tiny_src, tmp_path, "--shards", "1-3") == 0
    assert "3 written, 0 already complete" in capsys.readouterr().out
    victim = _files(tmp_path)[1]
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF  # a damaged header: not complete any more
    victim.write_bytes(bytes(data))
    assert convert(tiny_src, tmp_path, "--shards", "1-3") == 0
    assert "1 written, 2 already complete" in capsys.readouterr().out
    assert convert(tiny_src, tmp_path, "--shards", "1-3", "--force") == 0
    assert "3 written, 0 already complete" in capsys.readouterr().out


def test_killed_run_resumes_to_identical_files(tmp_path: Path) -> None:
    src = tmp_path / "layer"
    assert main(["synth", "--preset", "layer", "--experts", "8", "--out", str(src)]) == 0
    clean = tmp_path / "clean"
    assert convert(src, clean) == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "k3lab.cli", "convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]
    cmd += PER_LAYER
    proc = subprocess.Popen(cmd)
    deadline = time.time() + 60
    while time.time() < deadline:  # kill it while the big MoE file is half written
        partial = list(out.glob("*-00002-of-*.gguf.partial"))
        if partial and partial[0].stat().st_size > 20_000_000:
            break
        time.sleep(0.005)
    else:
        pytest.fail("the conversion never got half way")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (
        out / clean.glob("*-00002-of-*.gguf").__next__().name
    ).exists()  # no half file at a final path
    assert subprocess.run(cmd).returncode == 0
    for a in sorted(clean.glob("*.gguf")):
        assert a.read_bytes() == (out / a.name).read_bytes(), a.name
    assert not list(out.glob("*.partial"))


@pytest.fixture(scope="module")
def testmodel_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("testmodel") / "src"
    assert main(["synth", "--preset", "tiny-f32", "--layout", "one-file", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    ("outtype", "label", "matrix_type"),
    [("auto", "F32", "F32"), ("f16", "F16", "F16"), ("bf16", "BF16", "BF16")],
)
def test_unquantized_source_with_outtype(
    testmodel_src: Path, tmp_path: Path, outtype: str, label: str, matrix_type: str
) -> None:
    assert convert(testmodel_src, tmp_path, "--outtype", outtype, per_layer=False) == 0
    files = sorted(tmp_path.glob("*.gguf"))  # one file, named as upstream's converter names it
    assert [f.name for f in files] == [f"Kimi-K3-8x1.8M-{label}.gguf"]
    assert not [k for k in gguf.GGUFReader(files[0]).fields if k.startswith("split.")]
    src = Source(testmodel_src)
    by_name = {t.name: t for f in files for t in gguf.GGUFReader(f).tensors}
    q = by_name["blk.1.attn_q.weight"]
    assert q.tensor_type.name == matrix_type
    want = src.f32(LM + "layers.1.self_attn.q_proj.weight")
    got = dequantize(q.data, q.tensor_type).reshape(want.shape)
    cast = {"F32": np.float32, "F16": np.float16}.get(matrix_type)
    expected = (
        want.astype(cast).astype(np.float32)
        if cast
        else (
            (((want.view(np.uint32) + 0x7FFF + ((want.view(np.uint32) >> 16) & 1)) >> 16) << 16)
            .astype(np.uint32)
            .view(np.float32)
        )
    )
    assert np.array_equal(got, expected)
    exps = by_name["blk.2.ffn_down_exps.weight"]
    assert exps.tensor_type.name == matrix_type and list(exps.shape) == [64, 96, 8]
    assert by_name["blk.1.ssm_a"].tensor_type.name == "F32"
    assert by_name["blk.2.ffn_gate_inp.weight"].tensor_type.name == "F32"
    assert "kimi-k3.kda.gate_lower_bound" not in gguf.GGUFReader(files[0]).fields


@needs_llama
def test_llama_cpp_runs_the_unquantized_conversion(testmodel_src: Path, tmp_path: Path) -> None:
    import llama_cpp

    assert convert(testmodel_src, tmp_path, "--outtype", "f16", per_layer=False) == 0
    (one,) = tmp_path.glob("*.gguf")  # one file, no split keys: what a llama.cpp user expects
    llm = llama_cpp.Llama(str(one), n_ctx=64, n_threads=2, verbose=False)
    llm.eval(llm.tokenize(b"Hello world", add_bos=False))
    toks = []
    for _ in range(8):
        toks.append(llm.sample(top_k=1, temp=0.0))
        llm.eval([toks[-1]])
    assert len(toks) == 8 and len(set(toks)) > 1


def test_mxfp4_source_with_f16_keeps_the_experts(tiny_src: Path, tmp_path: Path) -> None:
    assert convert(tiny_src, tmp_path, "--outtype", "f16", "--shards", "2") == 0
    (f,) = tmp_path.glob("Kimi-K3-MXFP4-00002-of-00009.gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(f).tensors}
    assert types["blk.1.ffn_up_exps.weight"] == "MXFP4" and types["blk.1.attn_q.weight"] == "F16"


def test_plan_reports_files_tensors_disk_and_memory(
    tiny_src: Path, tiny_out: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--meta", str(tiny_src), "--json", *PER_LAYER]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["n_files"], plan["n_tensors"]) == (9, 218)
    by_file = {f["filename"]: f for f in plan["files"]}
    manifest = json.loads((tiny_out / "MANIFEST.json").read_text())
    for rec in manifest["files"]:  # the plan predicted every tensor's type, shape and size
        predicted = {t["name"]: (t["type"], t["ne"], t["bytes"]) for t in by_file[rec["file"]]["tensors"]}
        assert predicted == {t["name"]: (t["type"], t["ne"], t["nbytes"]) for t in rec["tensors"]}
    assert main(["plan", "--meta", str(tiny_src), "--jobs", "2", *PER_LAYER]) == 0
    table = capsys.readouterr().out
    assert "9 output files" in table and "disk: final" in table and "for --jobs 2" in table


def test_batch_needs_a_real_notebook(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "batch",
                "--notebook",
                str(tmp_path / "nope.ipynb"),
                "--meta",
                str(tiny_src),
                "--out-dir",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "nope.ipynb: notebook not found" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_streamed_hashes_stay_right_when_the_producer_reuses_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The writer hashes and writes on other threads while the producer refills its buffers: with the
    documented rotation (PIECES_IN_FLIGHT + 1 buffers) every digest and byte is still right."""
    import hashlib

    from k3lab.formats import direct_io
    from k3lab.formats import gguf_stream as gguf_io
    from k3lab.formats.gguf_stream import PIECES_IN_FLIGHT, GGUFStream, TensorInfo

    monkeypatch.setattr(gguf_io, "WRITEBACK_STEP", 3 << 20)  # and writeback requests on the way
    if mode == "buffered":
        monkeypatch.setattr(direct_io.DirectTail, "open", classmethod(lambda cls, fh, partial: None))
    else:
        monkeypatch.setattr(direct_io.DirectTail, "STAGE", 192 << 10)  # many full staging buffers
    fadvised: list[tuple[int, int]] = []
    real_fadvise = os.posix_fadvise

    def fadvise(fd: int, offset: int, n: int, advice: int) -> None:
        fadvised.append((offset, n))
        real_fadvise(fd, offset, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    rng = np.random.default_rng(7)
    pieces = [rng.integers(0, 256, 1 << 20, dtype=np.uint8) for _ in range(12)]
    bufs = [np.empty(1 << 20, np.uint8) for _ in range(PIECES_IN_FLIGHT + 1)]

    def produce(chunk: list[np.ndarray]):
        for i, p in enumerate(chunk):
            buf = bufs[i % len(bufs)]  # free again: its piece was hashed PIECES_IN_FLIGHT pieces ago
            buf[:] = 0
            buf[:] = p
            yield buf

    infos = [TensorInfo(f"t{k}", gguf.GGMLQuantizationType.I8, (len(pieces) // 2 << 20,)) for k in range(2)]
    path = tmp_path / "x.gguf"
    with GGUFStream(path, "test", [], infos) as g:
        digests = [g.write(f"t{k}", produce(pieces[k * 6 : k * 6 + 6])) for k in range(2)]
    assert digests == [
        hashlib.sha256(b"".join(p.tobytes() for p in pieces[k * 6 : k * 6 + 6])).hexdigest() for k in range(2)
    ]
    r = gguf.GGUFReader(path)
    for k, t in enumerate(r.tensors):
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.concatenate(pieces[k * 6 : k * 6 + 6]))
    if mode == "direct":  # no page cache to advise about
        assert not fadvised
        return
    # the requests cover the file front to back, each starting one step behind the last one's end
    assert len(fadvised) == 4 and fadvised[0][0] == 0  # 12 MiB in steps of 3 MiB
    assert all(b[0] < a[0] + a[1] <= b[0] + b[1] for a, b in zip(fadvised, fadvised[1:]))


@pytest.mark.parametrize("header_pad", [0, 4096 - 64, 3000])
def test_pieces_made_in_the_writers_buffers_give_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, header_pad: int
) -> None:
    """Pieces made in `GGUFStream.buffer` (sent by O_DIRECT from where they were made, the staged
    bytes before each filling its first block) mixed with ordinary pieces and padding: the file, every
    digest and the tensors gguf-py reads are those of plain buffered writes of the same bytes, whatever
    a piece's offset within a disk block (header sizes vary it), and with buffers reused in rotation."""
    import hashlib

    from k3lab.formats import direct_io
    from k3lab.formats.gguf_stream import KV, GGUFStream, TensorInfo

    rng = np.random.default_rng(header_pad)
    # odd piece sizes: some under one block, some over a staging buffer
    sizes = [[5_849_088, 4097, 77, 5_849_088, 300_001], [1_000_003], [4097, 4096 * 3, 12_345, 5_849_088]]
    data = [[rng.integers(0, 256, n, dtype=np.uint8) for n in t] for t in sizes]
    infos = [TensorInfo(f"t{k}", gguf.GGMLQuantizationType.I8, (sum(t),)) for k, t in enumerate(sizes)]
    kvs = [KV("general.name", "x" * header_pad, gguf.GGUFValueType.STRING)]

    early = np.empty(0, np.uint8)

    def pieces(g: GGUFStream, k: int):
        for i, d in enumerate(data[k]):
            if k == 1 or i == 2:  # an ordinary piece among placed ones
                yield d
                continue
            if k == 2 and i == 0:  # asked for before `write` padded the tensor's start: not its offset
                yield early
                continue
            buf = g.buffer(d.size)
            buf[:] = 0xAA  # garbage first: everything written must be the piece's own
            buf[:] = d
            yield buf

    def write(path: Path) -> tuple[bool, list[str]]:
        nonlocal early
        with GGUFStream(path, "test", kvs, infos) as g:
            direct = g._direct is not None
            digests = [g.write(f"t{k}", pieces(g, k)) for k in range(2)]
            early = g.buffer(data[2][0].size)  # (t1 ends unaligned: write pads before t2's first piece)
            early[:] = data[2][0]
            digests.append(g.write("t2", pieces(g, 2)))
        return direct, digests

    monkeypatch.setattr(direct_io.DirectTail, "STAGE", 1 << 20)
    direct, digests = write(tmp_path / "placed.gguf")
    if not direct:
        pytest.skip("SKIPPED LOUDLY: this filesystem refuses O_DIRECT; only the buffered path ran")
    assert digests == [hashlib.sha256(b"".join(d.tobytes() for d in t)).hexdigest() for t in data]
    monkeypatch.setattr(direct_io.DirectTail, "open", classmethod(lambda cls, fh, partial: None))
    assert write(tmp_path / "buffered.gguf") == (False, digests)
    assert (tmp_path / "placed.gguf").read_bytes() == (tmp_path / "buffered.gguf").read_bytes()
    for t, d in zip(gguf.GGUFReader(tmp_path / "placed.gguf").tensors, data):
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.concatenate(d))


def test_direct_and_buffered_writing_give_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT staging (aligned blocks, the header's last block rewritten, an unaligned tail) against
    plain buffered writes: odd piece sizes, padding between tensors, many staging buffers."""
    from k3lab.formats import direct_io
    from k3lab.formats.gguf_stream import KV, GGUFStream, TensorInfo

    rng = np.random.default_rng(11)
    sizes = [1_000_003, 77, 2_500_001]
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    infos = [TensorInfo(f"t{k}", gguf.GGMLQuantizationType.I8, (n,)) for k, n in enumerate(sizes)]
    kvs = [KV("general.name", "x" * 5000, gguf.GGUFValueType.STRING)]  # a header over one block

    def write(path: Path) -> bool:
        with GGUFStream(path, "test", kvs, infos) as g:
            direct = g._direct is not None
            for k, d in enumerate(data):
                g.write(f"t{k}", (d[i : i + 65_537] for i in range(0, len(d), 65_537)))
        return direct

    monkeypatch.setattr(direct_io.DirectTail, "STAGE", 256 << 10)
    if not write(tmp_path / "direct.gguf"):
        pytest.skip("SKIPPED LOUDLY: this filesystem refuses O_DIRECT; only the buffered path ran")
    monkeypatch.setattr(direct_io.DirectTail, "open", classmethod(lambda cls, fh, partial: None))
    assert not write(tmp_path / "buffered.gguf")
    assert (tmp_path / "direct.gguf").read_bytes() == (tmp_path / "buffered.gguf").read_bytes()
    r = gguf.GGUFReader(tmp_path / "direct.gguf")
    for t, d in zip(r.tensors, data):
        assert np.array_equal(np.asarray(t.data).view(np.uint8), d)
