"""Looking without downloading: the notebooks on a Hub source read only the bytes they show (the
loopback Hub counts every byte it serves), a view drawn again fetches nothing, and a GGUF set on the
Hub is verified by ranges: whole (`--all`), sampled or by glob, against its manifest or re-derived
from the source, also when another tool wrote it without a manifest."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import run_cli
from hub_server import HubServer
from notebook_runs import result_of, run_notebook

REPO = "moonshotai/Kimi-K3"
SET = "k3lab-test/Kimi-K3-GGUF"
INDEX = "model.safetensors.index.json"


def _header_len(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def _served_shards(hub: HubServer) -> dict[str, int]:
    out: dict[str, int] = {}
    for path, _, n in hub.served:
        if path.endswith(".safetensors"):
            out[path] = out.get(path, 0) + n
    return out


@pytest.fixture
def hub_env(tiny_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with HubServer(tiny_src) as hub:
        for k, v in hub.client_env(tmp_path).items():
            monkeypatch.setenv(k, v)
        yield hub


def _run(name: str, tmp: Path, **params: object) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    return result_of(run_notebook(name, tmp, **params))


def _tensor_bytes(src: Path, names: list[str]) -> int:
    from k3lab.formats.safetensors import read_header

    index = json.loads((src / INDEX).read_text())["weight_map"]
    total = 0
    for n in names:
        total += read_header(src / index[n])[0][n].nbytes
    return total


def test_notebook_01_on_the_hub_reads_headers_only(
    tiny_src: Path, tmp_path: Path, hub_env: HubServer
) -> None:
    r = _run(
        "01-tensor-layouts.ipynb",
        tmp_path,
        src=str(tmp_path / "meta"),
        repo=REPO,
        out_dir=str(tmp_path / "o"),
    )
    assert r["tensors"] == 76 and r["unmapped"] == []
    served = _served_shards(hub_env)
    text_shards = sorted(set(json.loads((tiny_src / INDEX).read_text())["weight_map"].values()))[:9]
    for shard in text_shards:  # planned from every header; shown: shard 2's header
        assert served.get(shard) == 8 + _header_len(tiny_src / shard), (shard, served.get(shard))
    assert r["fetched"] == sum(served.values())


def test_notebook_02_on_the_hub_reads_one_projections_scales_and_again_nothing(
    tiny_src: Path, tmp_path: Path, hub_env: HubServer
) -> None:
    from k3lab.kimi_k3.rules import expert_tensor

    params = dict(src=str(tmp_path / "meta"), repo=REPO, layers=[2], proj="w2", expert=1)
    r = _run("02-mxfp4-scales.ipynb", tmp_path, **params)
    assert len(r["summary"]) == 1 and r["summary"][0]["proj"] == "down (w2)"
    shard = json.loads((tiny_src / INDEX).read_text())["weight_map"][
        expert_tensor(2, 0, "w2", "weight_scale")
    ]
    scales = [expert_tensor(2, e, "w2", "weight_scale") for e in range(8)]
    shown = _tensor_bytes(tiny_src, scales) + _tensor_bytes(
        tiny_src, [expert_tensor(2, 1, "w2", "weight_packed")]
    )
    assert _served_shards(hub_env) == {shard: 8 + _header_len(tiny_src / shard) + shown}
    # the local checkpoint's numbers, from those bytes alone
    local = _run("02-mxfp4-scales.ipynb", tmp_path / "l", src=str(tiny_src), layers=[2], proj="w2", expert=1)
    assert r["summary"] == local["summary"] and r["code_counts"] == local["code_counts"]
    before = len(hub_env.served)
    again = _run("02-mxfp4-scales.ipynb", tmp_path / "again", **params)
    assert again["summary"] == r["summary"]
    assert not [s for s in hub_env.served[before:] if s[0].endswith(".safetensors")]  # all from the cache


@pytest.mark.slow  # (01 and 02 on the Hub run by default; 03 and 04 run locally by default)
def test_notebooks_03_and_04_on_the_hub_read_what_they_show(
    tiny_src: Path, tiny_out: Path, tmp_path: Path, hub_env: HubServer
) -> None:
    r3 = _run(
        "03-convert-a-file.ipynb",
        tmp_path,
        meta=str(tmp_path / "meta"),
        repo=REPO,
        shard=4,
        out_dir=str(tmp_path / "o"),
    )
    man = {
        t["name"]: t
        for f in json.loads((tiny_out / "MANIFEST.json").read_text())["files"]
        for t in f["tensors"]
    }
    assert r3["sha256"] == man[r3["tensor"]]["sha256"]  # the tensor made by ranges is the converted one
    assert not list((tmp_path / "o").glob("*.gguf"))  # nothing converted, nothing downloaded
    r4 = _run(
        "04-vision-and-tokenizer.ipynb",
        tmp_path / "v",
        src=str(tmp_path / "meta"),
        repo=REPO,
        sample_rows=2,
        check=False,
    )
    local = _run(
        "04-vision-and-tokenizer.ipynb", tmp_path / "l", src=str(tiny_src), mmproj_dir=str(tmp_path / "lv")
    )
    assert r4["parameters"] == local["parameters"] and r4["ids"] == local["ids"]
    assert r4["image_tokens"] == local["image_tokens"] and r4["prompt"] == local["prompt"]
    tower = _tensor_bytes(
        tiny_src,
        [
            n
            for n in json.loads((tiny_src / INDEX).read_text())["weight_map"]
            if n.startswith(("vision_tower.", "mm_projector."))
        ],
    )
    assert 0 < r4["fetched"] < tower / 4  # the spread of two rows per tensor
    # the stage check on the Hub: the whole tower read once by ranges (and its headers), all agreeing
    r5 = _run(
        "04-vision-and-tokenizer.ipynb",
        tmp_path / "c",
        src=str(tmp_path / "meta5"),
        repo=REPO,
        mmproj_dir=str(tmp_path / "cv"),
    )
    assert r5["stages"] == local["stages"] and all(ok for _, ok in r5["stages"])
    assert tower <= r5["fetched"] < tower + (1 << 20)


# --- a GGUF set on the Hub ---------------------------------------------------------------------------


@pytest.fixture
def set_hub(tiny_src: Path, tiny_out: Path, tmp_path: Path):
    """The tiny source at REPO and its converted set (with MANIFEST.json) at SET."""
    with HubServer(tiny_src) as hub:
        folder = tmp_path / "set"
        folder.mkdir()
        for p in list(tiny_out.glob("Kimi-K3-*.gguf")) + [tiny_out / "MANIFEST.json"]:
            shutil.copy(p, folder / p.name)
        hub.add_repo(SET, folder, large=None)
        yield hub, hub.client_env(tmp_path)


def test_verify_a_set_on_the_hub_whole_and_a_flipped_byte(tiny_out: Path, tmp_path: Path, set_hub) -> None:
    hub, env = set_hub
    ok = run_cli(env, "verify", SET, "--all")
    assert ok.returncode == 0 and "verify OK: 9 files, 218 tensors" in ok.stdout, ok.stdout + ok.stderr
    full = run_cli(env, "verify", SET, "--all", "--meta", str(tmp_path / "meta"), "--repo", REPO)
    assert full.returncode == 0 and "re-derived from the source" in full.stdout, full.stdout + full.stderr
    assert not list(tmp_path.rglob("*.incomplete")) and not list(tmp_path.rglob("k3lab-dl-*"))  # no download
    # one byte flipped in the repo: named, file and tensor
    name = "Kimi-K3-MXFP4-00003-of-00009.gguf"
    rec = next(f for f in json.loads((tiny_out / "MANIFEST.json").read_text())["files"] if f["file"] == name)
    t = rec["tensors"][5]
    data = bytearray(hub.files_of(SET)[name])
    data[t["offset"] + 3] ^= 0x10
    hub._new_commit({**hub.files_of(SET), name: bytes(data)}, "flip", SET)
    bad = run_cli(env, "verify", SET, "--all")
    assert (
        bad.returncode == 1 and f"{name}: tensor {t['name']}: SHA-256 differs from the manifest" in bad.stdout
    ), bad.stdout


def test_sample_and_tensors_read_only_what_they_say(tiny_out: Path, set_hub) -> None:
    hub, env = set_hub
    before = len(hub.served)
    head = run_cli(env, "verify", SET)
    assert head.returncode == 0 and "headers only" in head.stdout, head.stdout + head.stderr
    headers = {p: n for p, _, n in hub.served[before:] if p.endswith(".gguf")}
    man = json.loads((tiny_out / "MANIFEST.json").read_text())["files"]
    starts = {f["file"]: f["data_start"] for f in man}
    assert all(n <= max(4 * starts[p], 1 << 16) for p, n in headers.items())  # headers (and a probe's rest)
    before = len(hub.served)
    glob = run_cli(env, "verify", SET, "--tensors", "blk.3.attn_norm.weight")
    want = next(t["nbytes"] for f in man for t in f["tensors"] if t["name"] == "blk.3.attn_norm.weight")
    assert glob.returncode == 0 and f"218 tensors, {want} bytes checked" in glob.stdout, glob.stdout
    body = [n for p, r, n in hub.served[before:] if p.endswith(".gguf") and n == want]
    assert len(body) == 1  # that tensor's bytes, once
    seeded = run_cli(env, "verify", SET, "--sample", "1", "--seed", "7")
    again = run_cli(env, "verify", SET, "--sample", "1", "--seed", "7")
    assert "seed 7" in seeded.stdout and seeded.stdout == again.stdout


def _rewrite_as_another_tool(tiny_out: Path, dest: Path) -> list[str]:
    """The set as another converter might write it: every tensor in two files, another order, no
    manifest, no k3lab record."""
    tensors = []
    for p in sorted(tiny_out.glob("Kimi-K3-*.gguf")):
        r = gguf.GGUFReader(p)
        for t in r.tensors:
            tensors.append((t.name, t.tensor_type, [int(n) for n in t.shape], np.array(t.data)))
    tensors.sort(key=lambda t: t[0])
    halves = [tensors[: len(tensors) // 2], tensors[len(tensors) // 2 :]]
    names = []
    for k, part in enumerate(halves):
        name = f"Other-Q-0000{k + 1}-of-00002.gguf"
        w = gguf.GGUFWriter(dest / name, "kimi-k3")
        w.add_uint16("split.no", k)
        w.add_uint16("split.count", 2)
        w.add_int32("split.tensors.count", len(tensors))
        for tname, ttype, _, data in part:  # (bytes as gguf-py reads them: its writer takes them back)
            w.add_tensor(tname, data, raw_dtype=ttype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        names.append(name)
    return names


def test_a_set_another_tool_wrote_is_verified_against_the_source(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "other"
    folder.mkdir()
    names = _rewrite_as_another_tool(tiny_out, folder)
    with HubServer(tiny_src) as hub:
        hub.add_repo("someone/Other-GGUF", folder, large=None)
        env = hub.client_env(tmp_path)
        src = ["--meta", str(tmp_path / "meta"), "--repo", REPO]
        ok = run_cli(env, "verify", "someone/Other-GGUF", "--all", *src)
        assert ok.returncode == 0 and "re-derived from the source" in ok.stdout, ok.stdout + ok.stderr
        r = gguf.GGUFReader(folder / names[1])
        t = next(t for t in r.tensors if t.name.endswith("ffn_down_exps.weight"))
        data = bytearray((folder / names[1]).read_bytes())
        data[int(t.data_offset) + 17] ^= 0x01
        hub._new_commit(
            {**hub.files_of("someone/Other-GGUF"), names[1]: bytes(data)}, "flip", "someone/Other-GGUF"
        )
        bad = run_cli(env, "verify", "someone/Other-GGUF", "--tensors", t.name, *src)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"{names[1]}: tensor {t.name}: re-derived from the source, SHA-256 differs" in bad.stdout


@pytest.mark.parametrize(
    "mode, needle", [("html", "web page"), ("long", "more than the"), ("endless", "without that range")]
)
def test_a_wrong_answer_from_a_set_repo_is_one_line(set_hub, mode: str, needle: str) -> None:
    hub, env = set_hub
    hub.hostile["Kimi-K3-MXFP4-00004-of-00009.gguf"] = mode
    r = run_cli(env, "verify", SET)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "00004-of-00009" in lines[0], (
        r.stderr
    )


def test_a_moved_or_missing_revision_is_one_line(set_hub) -> None:
    hub, env = set_hub
    r = run_cli(env, "verify", SET, "--revision", "no-such-branch")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "no-such-branch" in lines[0], r.stderr


def test_the_header_parser_agrees_with_gguf_py(tiny_out: Path, tmp_path: Path) -> None:
    """k3lab's bounded header parser against gguf-py's reader, on every file of a set, on the mmproj
    and the tokenizer GGUF, and on a file another writer made; cut anywhere inside the header it asks
    for more, never misparses."""
    from k3lab.formats import gguf_header

    _rewrite_as_another_tool(tiny_out, tmp_path)
    files = sorted(tiny_out.glob("*.gguf")) + sorted(tmp_path.glob("*.gguf"))
    assert len(files) >= 11
    for path in files:
        data = path.read_bytes()
        mine = gguf_header.parse(data, ("split.no", "split.count"), len(data))
        theirs = gguf.GGUFReader(path)
        assert mine.data_start == theirs.data_offset, path.name
        assert [(t.name, t.type, t.ne, t.offset, t.nbytes) for t in mine.tensors] == [
            (t.name, t.tensor_type.name, tuple(int(n) for n in t.shape), int(t.data_offset), int(t.n_bytes))
            for t in theirs.tensors
        ], path.name
        for key in ("split.no", "split.count"):
            if key in theirs.fields:
                assert mine.kvs[key] == theirs.fields[key].contents(), (path.name, key)
        for cut in (5, 24, mine.data_start // 2, mine.data_start - 1):
            try:  # more is asked for, or (cut in the padding before the data) the same header found
                early = gguf_header.parse(data[:cut], (), len(data))
            except gguf_header.NeedMore as more:
                assert cut < more.at_least <= mine.data_start, (path.name, cut)
            else:
                assert early.data_start == mine.data_start and early.tensors == mine.tensors, (path.name, cut)


def test_verify_on_the_hub_covers_the_files_beside_the_set(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """The set as a publishing run leaves it (the split set, the mmproj, the tokenizer GGUF, one
    manifest): every file counted and checked against the manifest, the mmproj also re-derived from
    the source by ranges; one of them gone from the repo, or another source, is named."""
    from k3lab.cli import main

    folder = tmp_path / "set"
    shutil.copytree(tiny_out, folder)
    assert main(["vision", "--meta", str(tiny_src), "--out", str(folder / "mmproj-Kimi-K3-BF16.gguf")]) == 0
    assert main(["tokenizer", "--meta", str(tiny_src), "--out", str(folder / "Kimi-K3-tokenizer.gguf")]) == 0
    mm = len(gguf.GGUFReader(folder / "mmproj-Kimi-K3-BF16.gguf").tensors)
    with HubServer(tiny_src) as hub:
        hub.add_repo(SET, folder, large=None)
        env = hub.client_env(tmp_path)
        ok = run_cli(env, "verify", SET, "--all")
        assert ok.returncode == 0 and f"verify OK: 11 files, {218 + mm} tensors" in ok.stdout, (
            ok.stdout + ok.stderr
        )
        src = ["--meta", str(tmp_path / "meta"), "--repo", REPO]
        full = run_cli(env, "verify", SET, "--all", *src)
        assert full.returncode == 0 and "re-derived from the source" in full.stdout, full.stdout + full.stderr
        files = hub.files_of(SET)
        hub._new_commit({n: b for n, b in files.items() if n != "Kimi-K3-tokenizer.gguf"}, "drop", SET)
        gone = run_cli(env, "verify", SET)
        assert (
            gone.returncode == 1
            and "Kimi-K3-tokenizer.gguf: in MANIFEST.json, not in the repo" in gone.stdout
        )
    # another source (another seed): the mmproj's tensors are not what it gives
    other = tmp_path / "other-src"
    from k3lab.kimi_k3.synth import synthesize

    synthesize("tiny", other, seed=1)
    with HubServer(other) as hub:
        hub.add_repo(SET, folder, large=None)
        env = hub.client_env(tmp_path / "o")
        bad = run_cli(
            env, "verify", SET, "--tensors", "v.blk.0.*", "--meta", str(tmp_path / "o-meta"), "--repo", REPO
        )
        said = "6 problems: tensors the source re-derives differently (1 files: mmproj-Kimi-K3-BF16.gguf)"
        assert bad.returncode == 1 and said in bad.stdout, bad.stdout + bad.stderr


def _strangers(tiny_out: Path, folder: Path) -> list[str]:
    """Files anyone may add beside a set: named like its file 1 of another count, text, empty, cut
    short, a header claiming 10^12 keys, thirty valid GGUFs, and a note."""
    first = sorted(tiny_out.glob("Kimi-K3-*.gguf"))[0].read_bytes()
    made = {
        "Kimi-K3-MXFP4-00001-of-00003.gguf": first,  # (a real file 1, of another count)
        "junk.gguf": b"not a gguf at all\n" * 100,
        "empty.gguf": b"",
        "cut.gguf": first[: len(first) // 3],
        "keys.gguf": b"GGUF" + struct.pack("<IQQ", 3, 0, 10**12),
        "notes.txt": b"hello\n",
    }
    for k in range(30):
        made[f"valid-{k:02d}.gguf"] = first
    for name, data in made.items():
        (folder / name).write_bytes(data)
    return sorted(made)


def test_verify_on_the_hub_checks_the_set_among_strangers(
    tiny_out: Path, tmp_path: Path, tiny_src: Path
) -> None:
    """A repo holding the set, its manifest and 36 strangers (unreadable, empty, cut, absurd, valid, one
    named like the set's file 1 of another count): the set verifies (exit 0, its 9 files counted, no
    stranger read), every stranger is named; a flipped byte in the real file 1 is still named as such."""
    folder = tmp_path / "set"
    folder.mkdir()
    for p in list(tiny_out.glob("Kimi-K3-*.gguf")) + [tiny_out / "MANIFEST.json"]:
        shutil.copy(p, folder / p.name)
    strangers = _strangers(tiny_out, folder)
    with HubServer(tiny_src) as hub:
        hub.add_repo(SET, folder, large=None)
        env = hub.client_env(tmp_path)
        before = len(hub.served)
        ok = run_cli(env, "verify", SET, "--all")
        assert ok.returncode == 0 and "verify OK: 9 files, 218 tensors" in ok.stdout, ok.stdout + ok.stderr
        said = next(ln for ln in ok.stdout.splitlines() if ln.startswith("not of the set"))
        assert f"{len(strangers)} file(s): " in said and all(n in said for n in strangers[:12]), said
        assert f"and {len(strangers) - 12} more" in said, said
        read = {p for p, _, _ in hub.served[before:]}
        assert not read & set(strangers), read & set(strangers)  # (never read)
        name = sorted(p.name for p in tiny_out.glob("Kimi-K3-*.gguf"))[0]
        rec = next(
            f for f in json.loads((tiny_out / "MANIFEST.json").read_text())["files"] if f["file"] == name
        )
        data = bytearray(hub.files_of(SET)[name])
        data[rec["tensors"][0]["offset"]] ^= 0x01
        hub._new_commit({**hub.files_of(SET), name: bytes(data)}, "flip", SET)
        bad = run_cli(env, "verify", SET, "--all")
        assert bad.returncode == 1, bad.stdout + bad.stderr
        problems = [
            ln for ln in bad.stdout.splitlines() if not ln.startswith(("not of the set", "verify", "("))
        ]
        assert problems == [
            f"{name}: tensor {rec['tensors'][0]['name']}: SHA-256 differs from the manifest"
        ], bad.stdout


def test_verify_on_the_hub_without_a_manifest_is_not_stopped_by_one_file(
    tiny_out: Path, tmp_path: Path, tiny_src: Path
) -> None:
    """No manifest: every .gguf is taken for the set's, so the unreadable ones are named (exit 1), each
    on its own; none stops the check of the others, and none replaces the set's file 1."""
    folder = tmp_path / "set"
    folder.mkdir()
    for p in tiny_out.glob("Kimi-K3-*.gguf"):
        shutil.copy(p, folder / p.name)
    for name, data in {
        "junk.gguf": b"text\n" * 10,
        "empty.gguf": b"",
        "zz-cut.gguf": b"GGUF\x03\x00",
    }.items():
        (folder / name).write_bytes(data)
    with HubServer(tiny_src) as hub:
        hub.add_repo(SET, folder, large=None)
        r = run_cli(hub.client_env(tmp_path), "verify", SET)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    out = r.stdout
    for name in ("junk.gguf", "empty.gguf", "zz-cut.gguf"):
        assert any(ln.startswith(f"{name}: ") for ln in out.splitlines()), out
    assert "verify FAILED: 3 problem(s): 12 files, 218 tensors" in out, out


def test_verify_on_the_hub_of_a_split_set_beside_another_sets_manifest_names_both(
    tiny_out: Path, tiny_one: Path, tmp_path: Path, tiny_src: Path
) -> None:
    """A repo holding the split set's nine files and a one-file set's manifest: the manifest's file is
    named missing, the nine named as not of the set; exit 1 (never "holds no GGUF file")."""
    folder = tmp_path / "set"
    folder.mkdir()
    for p in tiny_out.glob("Kimi-K3-*.gguf"):
        shutil.copy(p, folder / p.name)
    shutil.copy(tiny_one / "MANIFEST.json", folder / "MANIFEST.json")
    (one,) = [p.name for p in tiny_one.glob("*.gguf")]
    with HubServer(tiny_src) as hub:
        hub.add_repo(SET, folder, large=None)
        r = run_cli(hub.client_env(tmp_path), "verify", SET)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"{one}: in MANIFEST.json, not in the repo" in r.stdout, r.stdout
        said = next(ln for ln in r.stdout.splitlines() if ln.startswith("not of the set"))
        assert "9 file(s): " in said and "Kimi-K3-MXFP4-00001-of-00009.gguf" in said, said
        assert "holds no GGUF" not in r.stdout + r.stderr
