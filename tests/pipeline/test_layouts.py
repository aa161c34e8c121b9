"""Kimi-K3 as it is shipped and as anyone re-saves it: one model.safetensors, transformers' size
shards (a layer across files), Moonshot's layer per shard; the output files are cut by the model
(whole layers), never by the source's files."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from checkpoint_edits import KILL_AT, read_tensors, write_tensors
from conftest import PER_LAYER, convert, state_json
from hub_server import HubServer
from judges import expected_tensor
from llama_support import needs_llama

from k3lab.cli import main
from k3lab.kimi_k3.synth import synthesize
from k3lab.kimi_k3.synth.presets import tiny_config

LAYOUTS = ("moonshot", "one-file", "by-size:700000")
ONE = "Kimi-K3-8x1.9M-MXFP4.gguf"  # tiny in one file: name, size label, type, as upstream names it


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tiny (seed 0) written in each layout."""
    root = tmp_path_factory.mktemp("layouts")
    return {lay: synthesize("tiny", root / lay.replace(":", "-"), layout=lay).out for lay in LAYOUTS}


def _ggufs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.gguf"))}


def _manifest(out: Path) -> dict:
    return json.loads((out / "MANIFEST.json").read_text())


def test_synth_writes_the_three_layouts_as_transformers_and_moonshot_do(sources: dict[str, Path]) -> None:
    moonshot = sorted(p.name for p in sources["moonshot"].glob("*.safetensors"))
    assert moonshot[0] == "model-00001-of-000011.safetensors" and len(moonshot) == 11  # five digits over six
    assert sorted(p.name for p in sources["one-file"].glob("*.safetensors")) == ["model.safetensors"]
    assert not (sources["one-file"] / "model.safetensors.index.json").exists()
    index = json.loads((sources["by-size:700000"] / "model.safetensors.index.json").read_text())["weight_map"]
    homes: dict[str, set[str]] = {}
    for name, file in index.items():
        if ".layers." in name:
            homes.setdefault(name.split(".layers.")[1].split(".")[0], set()).add(file)
    assert max(len(f) for f in homes.values()) >= 2  # a layer spread over files, as a re-save has it
    entries = read_tensors(sources["by-size:700000"] / "model-00002-of-00008.safetensors")
    assert [e[0] for e in entries] != sorted(e[0] for e in entries) or len({e[1] for e in entries}) > 1


def test_every_layout_converts_to_one_identical_file(sources: dict[str, Path], tmp_path: Path) -> None:
    made = {}
    for lay, src in sources.items():
        out = tmp_path / lay.replace(":", "-")
        assert convert(src, out, per_layer=False) == 0, lay
        files = _ggufs(out)
        assert list(files) == [ONE], lay
        fields = gguf.GGUFReader(out / ONE).fields
        assert not [k for k in fields if k.startswith("split.")], lay  # one file: no split keys
        (rec,) = _manifest(out)["files"]
        listed = {s["file"] for s in rec["sources"]}
        assert listed == {x["file"] for t in rec["tensors"] for x in t["sources"]}, lay
        assert main(["verify", str(out), "--src", str(src), "--quiet"]) == 0, lay
        made[lay] = files
    assert made["moonshot"] == made["one-file"] == made["by-size:700000"]


def test_a_layer_per_file_is_the_same_from_every_layout(
    sources: dict[str, Path], tiny_out: Path, tmp_path: Path
) -> None:
    want = _ggufs(tiny_out)
    for lay, src in sources.items():
        out = tmp_path / lay.replace(":", "-")
        assert convert(src, out, "--jobs", "2") == 0, lay
        assert _ggufs(out) == want, lay
        for rec in _manifest(out)["files"]:  # whole layers: every blk.N of a file is its own layer
            layers = {t["name"].split(".")[1] for t in rec["tensors"] if t["name"].startswith("blk.")}
            assert len(layers) <= 1, (lay, rec["file"], layers)
    spread = [r for r in _manifest(tmp_path / "by-size-700000")["files"] if len(r["sources"]) > 1]
    assert spread  # an output file made from two source files


def test_split_max_size_packs_whole_layers(tiny_src: Path, tiny_one: Path, tmp_path: Path) -> None:
    assert convert(tiny_src, tmp_path, "--split-max-size", "1M", per_layer=False) == 0
    files = sorted(tmp_path.glob("*.gguf"))
    n = len(files)
    assert 2 <= n < 9 and files[0].name == f"Kimi-K3-MXFP4-00001-of-{n:05d}.gguf"
    seen: dict[str, str] = {}
    for k, path in enumerate(files):
        r = gguf.GGUFReader(path)
        assert r.fields["split.no"].contents() == k and r.fields["split.count"].contents() == n
        assert r.fields["split.tensors.count"].contents() == 218
        layers = {t.name.split(".")[1] for t in r.tensors if t.name.startswith("blk.")}
        data = sum(int(t.n_bytes) for t in r.tensors)
        assert data <= 1_000_000 or len(layers) == 1, (path.name, data, layers)
        for layer in layers:
            assert seen.setdefault(layer, path.name) == path.name  # a layer never spans two files
    one = {t.name: bytes(t.data) for t in gguf.GGUFReader(tiny_one / ONE).tensors}
    split = {t.name: bytes(t.data) for f in files for t in gguf.GGUFReader(f).tensors}
    assert split == one  # the same tensors, cut otherwise
    assert main(["verify", str(tmp_path), "--src", str(tiny_src), "--quiet"]) == 0


def test_the_folder_remembers_its_split_and_a_new_split_replaces_the_old_files(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert convert(tiny_src, tmp_path) == 0  # a layer per file
    capsys.readouterr()
    assert convert(tiny_src, tmp_path, per_layer=False) == 0  # no flag: the same split, all complete
    assert "0 written, 9 already complete" in capsys.readouterr().out
    args = ["convert", "--meta", str(tiny_src), "--out-dir", str(tmp_path), "--split-max-size", "50G"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "1 written" in captured.out
    assert "removed the 9 files of its earlier split that k3lab wrote here" in captured.err
    assert list(_ggufs(tmp_path)) == [ONE]
    assert main(["verify", str(tmp_path), "--quiet"]) == 0


def test_files_is_the_name_of_shards(tiny_src: Path, tmp_path: Path, capsys) -> None:
    assert convert(tiny_src, tmp_path, "--files", "2-3") == 0
    assert "2 written, 0 already complete" in capsys.readouterr().out
    assert (
        main(["convert", "--meta", str(tiny_src), "--out-dir", str(tmp_path), "--quiet", "--files", "10"])
        == 2
    )
    assert "outside 1..9" in capsys.readouterr().err


def test_a_changed_source_file_redoes_exactly_the_output_files_that_read_it(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["by-size:700000"], src)
    out = tmp_path / "out"
    assert convert(src, out) == 0
    plan = state_json(out / ".k3lab" / "plan.json")
    readers: dict[str, list[int]] = {}
    for f in plan["files"]:
        for s in f["sources"]:
            readers.setdefault(s["file"], []).append(f["number"])
    shared = next(file for file, numbers in sorted(readers.items()) if len(numbers) == 2)
    before = {p.name: p.stat().st_ino for p in out.glob("*.gguf")}
    path = src / shared
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = {"format": "pt", "saved_by": "another tool"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    capsys.readouterr()
    assert convert(src, out) == 0
    assert "2 written, 7 already complete" in capsys.readouterr().out
    after = {p.name: p.stat().st_ino for p in out.glob("*.gguf")}
    redone = sorted(int(name.split("-")[-3]) for name in after if after[name] != before[name])
    assert redone == readers[shared]


def _state(path: Path, kind: str, body: dict) -> None:
    data = (json.dumps(body, sort_keys=True) + "\n").encode()
    path.write_bytes(f"k3lab-state/1 {kind} {hashlib.sha256(data).hexdigest()}\n".encode() + data)


def test_a_set_written_before_files_could_read_several_sources_is_still_complete(
    tiny_src: Path, tiny_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Records as k3lab wrote them until this version (k3lab-manifest/2, one "source" per file) and
    no plan it can read (k3lab-plan/2): the set re-plans and every file is found complete."""
    out = tmp_path / "out"
    shutil.copytree(tiny_out, out)
    for path in sorted((out / ".k3lab").glob("0*.json")):
        rec = state_json(path)
        rec["format"] = "k3lab-manifest/2"
        rec["source"] = rec.pop("sources")[0]
        _state(path, "record", rec)
    (out / ".k3lab" / "plan.json").unlink()
    capsys.readouterr()
    assert convert(tiny_src, out) == 0
    assert "0 written, 9 already complete" in capsys.readouterr().out


# --- bad input: one line before anything is written ----------------------------------------------------


def _one_line_and_nothing_written(src: Path, tmp_path: Path, capsys, *needles: str) -> None:
    out = tmp_path / "out"
    assert main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3lab: error: "), err
    for needle in needles:
        assert needle in err[0], (needle, err[0])
    assert not out.exists()


def test_a_tensor_of_no_layer_is_one_line(sources: dict[str, Path], tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["one-file"], src)
    ts = read_tensors(src / "model.safetensors")
    ts.append(["language_model.model.mystery.weight", "BF16", (4,), b"\0" * 8])
    write_tensors(src / "model.safetensors", ts)
    _one_line_and_nothing_written(
        src, tmp_path, capsys, "model.safetensors", "mystery.weight", "not used by any rule"
    )


def test_two_files_holding_one_tensor_is_one_line(sources: dict[str, Path], tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["by-size:700000"], src)
    a, b = "model-00002-of-00008.safetensors", "model-00003-of-00008.safetensors"
    extra = read_tensors(src / a)[0]
    write_tensors(src / b, [*read_tensors(src / b), extra])
    _one_line_and_nothing_written(src, tmp_path, capsys, b, extra[0], "the index does not list it here")


def test_a_tensor_in_another_dtype_than_the_config_is_one_line(
    sources: dict[str, Path], tmp_path: Path, capsys
) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["one-file"], src)
    ts = read_tensors(src / "model.safetensors")
    name = "language_model.model.layers.3.self_attn.q_a_proj.weight"
    for t in ts:
        if t[0] == name:
            t[1] = "F16"  # the same bytes, read as another float type than config.json declares
    write_tensors(src / "model.safetensors", ts)
    _one_line_and_nothing_written(src, tmp_path, capsys, "model.safetensors", name, "F16", "expected BF16")


def test_packed_experts_without_a_quantization_config_are_one_line(
    sources: dict[str, Path], tmp_path: Path, capsys
) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["one-file"], src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    _one_line_and_nothing_written(
        src, tmp_path, capsys, "model.safetensors", "weight_packed", "config.json has no quantization_config"
    )


def test_a_folder_with_neither_index_nor_model_safetensors_is_one_line(
    sources: dict[str, Path], tmp_path: Path, capsys
) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["one-file"], src)
    (src / "model.safetensors").rename(src / "weights.safetensors")
    _one_line_and_nothing_written(
        src, tmp_path, capsys, "no model.safetensors.index.json and no model.safetensors"
    )


# --- Moonshot's own modeling code, saved as transformers saves it -------------------------------------


class StateDict:
    """A torch state dict read as test_convert's source reader reads a checkpoint."""

    def __init__(self, net):
        self.sd = net.state_dict()

    def raw(self, name: str) -> np.ndarray:
        import torch

        t = self.sd[name].detach().cpu().contiguous()
        return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

    def f32(self, name: str) -> np.ndarray:
        return self.sd[name].detach().float().numpy()

    def has(self, name: str) -> bool:
        return name in self.sd


@pytest.fixture(scope="module")
def moonshot_net():
    import moonshot

    return moonshot.build(tiny_config(), seed=7)


@pytest.mark.parametrize("layout", ["one-file", "by-size:600000", "per-layer"])
def test_moonshots_own_checkpoints_convert_in_every_layout(
    moonshot_net, sources: dict[str, Path], tmp_path: Path, layout: str
) -> None:
    """A KimiK3ForConditionalGeneration made by Moonshot's classes (plain BF16 experts under a config
    that still names MXFP4: the headers decide), saved by save_pretrained in ``layout``: one file whose
    every tensor is the model's own parameter under its transform, bit for bit."""
    import moonshot

    src = moonshot.save(moonshot_net, tmp_path / "src", layout, tokenizer_from=sources["moonshot"])
    out = tmp_path / "out"
    assert convert(src, out, per_layer=False) == 0
    (path,) = sorted(out.glob("*.gguf"))
    assert path.name == "Kimi-K3-8x1.9M-BF16.gguf"
    cfg = json.loads((src / "config.json").read_text())
    judge, seen = StateDict(moonshot_net), 0
    for t in gguf.GGUFReader(path).tensors:
        gtype, want = expected_tensor(judge, t.name, cfg)
        assert t.tensor_type.name == gtype, t.name
        bits = np.uint16 if gtype == "BF16" else np.uint32
        want = np.ascontiguousarray(want, dtype=np.float32 if gtype == "F32" else None)
        got = np.asarray(t.data).view(bits).reshape(want.shape)
        assert np.array_equal(got, want.view(bits)), t.name
        seen += 1
    assert seen == 218
    assert main(["verify", str(out), "--src", str(src), "--quiet"]) == 0


def test_moonshots_checkpoints_give_the_same_file_whatever_the_layout(
    moonshot_net, sources: dict[str, Path], tmp_path: Path
) -> None:
    import moonshot

    made = set()
    for layout in ("one-file", "by-size:600000", "per-layer"):
        src = moonshot.save(moonshot_net, tmp_path / layout, layout, tokenizer_from=sources["moonshot"])
        out = tmp_path / f"out-{layout}"
        assert convert(src, out, per_layer=False) == 0
        made.add(hashlib.sha256(next(out.glob("*.gguf")).read_bytes()).hexdigest())
    assert len(made) == 1


@needs_llama
def test_llama_cpp_runs_moonshots_checkpoint_saved_in_size_shards(
    moonshot_net, sources: dict[str, Path], tmp_path: Path
) -> None:
    import llama_cpp
    import moonshot

    src = moonshot.save(moonshot_net, tmp_path / "src", "by-size:600000", tokenizer_from=sources["moonshot"])
    for split, extra in (("one", ()), ("layers", PER_LAYER)):
        out = tmp_path / split
        assert convert(src, out, *extra, per_layer=False) == 0
        first = sorted(out.glob("*.gguf"))[0]
        llm = llama_cpp.Llama(str(first), n_ctx=64, n_threads=2, verbose=False)
        llm.eval(llm.tokenize(b"The quick brown fox", add_bos=False))
        tokens = []
        for _ in range(6):
            tokens.append(llm.sample(top_k=1, temp=0.0))
            llm.eval([tokens[-1]])
        assert len(tokens) == 6
        del llm


# --- the Hub, any layout -------------------------------------------------------------------------------


def _hub_convert(hub: HubServer, tmp: Path, *extra: str) -> None:
    args = ["--repo", "moonshotai/Kimi-K3", "--meta", str(tmp / "meta"), "--out-dir", str(tmp / "out")]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "k3lab.cli",
            "convert",
            *args,
            "--scratch",
            str(tmp / "scratch"),
            "--quiet",
            *extra,
        ],
        env=hub.client_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_a_one_file_checkpoint_on_the_hub_is_one_download(sources: dict[str, Path], tmp_path: Path) -> None:
    src = sources["one-file"]
    with HubServer(src) as hub:
        _hub_convert(hub, tmp_path)
        size = (src / "model.safetensors").stat().st_size
        served = hub.served_bytes("model.safetensors")
        whole = [a for p, a in hub.downloads() if p == "model.safetensors"]
    (n,) = struct.unpack("<Q", (src / "model.safetensors").read_bytes()[:8])
    assert whole == [0] and served <= size + 8 + (8 + n)  # one download, and the header's ranged reads
    assert list(_ggufs(tmp_path / "out")) == [ONE]
    local = tmp_path / "local"
    assert convert(src, local, per_layer=False) == 0
    assert _ggufs(tmp_path / "out") == _ggufs(local)
    assert not list((tmp_path / "scratch").rglob("*.safetensors"))


def test_size_shards_on_the_hub_keep_a_file_the_next_task_reads(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """A layer per output file from size shards: a source file that the next output file reads too is
    kept for it (the process knows it converts it next), never downloaded twice; a file read again
    only later (the embeddings, by the output tensors at the end) is downloaded again, so that the
    disk holds no more than the files one tensor reads, one prefetched and one kept."""
    src = sources["by-size:700000"]
    with HubServer(src) as hub:
        _hub_convert(hub, tmp_path, *PER_LAYER)
        starts = sorted(p for p, a in hub.downloads() if a == 0)
    plan = state_json(tmp_path / "out" / ".k3lab" / "plan.json")
    expected = []
    for k, f in enumerate(plan["files"]):
        before = {s["file"] for s in plan["files"][k - 1]["sources"]} if k else set()
        expected += [s["file"] for s in f["sources"] if s["file"] not in before]
    assert starts == sorted(expected), (starts, expected)
    assert len(starts) < sum(len(f["sources"]) for f in plan["files"])  # (some were kept)
    local = tmp_path / "local"
    assert convert(src, local) == 0
    assert _ggufs(tmp_path / "out") == _ggufs(local)
    assert not list((tmp_path / "scratch").rglob("*.safetensors"))


def test_kill_9_on_size_shards_resumes_to_identical_files(sources: dict[str, Path], tmp_path: Path) -> None:
    """kill -9 of a run on size shards after its k-th rename (a file done, its record not yet, the
    next begun): the rerun finishes the set, byte-identical to a clean one."""
    src = sources["by-size:700000"]
    clean = tmp_path / "clean"
    assert convert(src, clean) == 0
    for point in (4, 9):
        out = tmp_path / f"killed-{point}"
        args = ["convert", "--meta", str(src), "--out-dir", str(out), "--quiet", *PER_LAYER]
        run = subprocess.run(
            [sys.executable, "-c", KILL_AT, str(point), *args], capture_output=True, timeout=120
        )
        assert run.returncode == -9, run.stderr
        assert convert(src, out) == 0
        assert _ggufs(out) == _ggufs(clean), point
        assert not list(out.rglob("*.partial"))


def test_dask_workers_that_share_nothing_publish_size_shards_from_the_hub(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """Size shards on the Hub, a layer per output file, two `dask worker`s with folders of their own
    publishing each file: the repo holds the local conversion's bytes, and `verify ORG/NAME` re-derives
    every tensor from the source's ranges."""
    from dask_helpers import dask_cluster

    src = sources["by-size:700000"]
    local = tmp_path / "local"
    assert convert(src, local) == 0
    with dask_cluster(tmp_path) as (address, _), HubServer(src) as hub:
        _hub_convert(
            hub, tmp_path, *PER_LAYER, "--scheduler", address, "--push-to", "k3lab-test/sized", "--text-only"
        )
        pushed = {p: d for p, d in hub.files_of("k3lab-test/sized").items() if p.endswith(".gguf")}
        check = subprocess.run(
            [
                sys.executable,
                "-m",
                "k3lab.cli",
                "verify",
                "k3lab-test/sized",
                "--all",
                "--repo",
                "moonshotai/Kimi-K3",
            ]
            + ["--meta", str(tmp_path / "meta"), "--quiet"],
            env=hub.client_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert pushed == _ggufs(local)
    assert check.returncode == 0 and "verify OK" in check.stdout, check.stdout + check.stderr
