"""Publishing to the Hub: a real scheduler and two workers whose folders are their own (each its
`--local-directory`), a loopback Hub that takes uploads (pre-upload, LFS batch, PUT, commit) and keeps
commits. The repo ends with the whole set, byte-identical to a local conversion, that `k3lab verify`
passes on a snapshot and llama.cpp loads; a second run uploads nothing; a killed run, rerun, uploads
only the rest; `k3lab publish` does the same for a local set."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PER_LAYER, run_cli
from dask_helpers import dask_cluster
from hub_server import HubServer, git_blob_id
from llama_support import needs_llama

SOURCE = "moonshotai/Kimi-K3"
TARGET = "k3lab-test/Kimi-K3-GGUF"
TOKEN = "hf_publish_secret_0123456789"


@pytest.fixture(scope="module")
def private_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Path]]]:
    with dask_cluster(tmp_path_factory.mktemp("pcluster")) as found:
        yield found


def _env(hub: HubServer, tmp: Path) -> dict[str, str]:
    return hub.client_env(tmp, TOKEN)


def _convert_args(tmp: Path, *extra: str) -> list[str]:
    # a layer per file: each task publishes its own file
    out = ["convert", "--repo", SOURCE, "--meta", str(tmp / "meta"), "--out-dir", str(tmp / "out")]
    return [*out, *PER_LAYER, *extra]


def _repo_ggufs(hub: HubServer, repo: str = TARGET, branch: str = "main") -> dict[str, bytes]:
    return {p: d for p, d in hub.files_of(repo, branch).items() if p.endswith(".gguf")}


def _snapshot(hub: HubServer, tmp: Path, dest: Path) -> Path:
    """The repo downloaded as a user would, file by file with huggingface_hub (the loopback Hub has
    no tree listing for snapshot_download)."""
    code = (
        "import sys; from huggingface_hub import HfApi, hf_hub_download\n"
        "for s in HfApi().model_info(sys.argv[1]).siblings:\n"
        "    hf_hub_download(sys.argv[1], s.rfilename, local_dir=sys.argv[2])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, TARGET, str(dest)], env=_env(hub, tmp), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return dest


def _no_token_on_disk(*roots: Path) -> None:
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file() and not p.is_symlink():
                assert TOKEN.encode() not in p.read_bytes(), p


def test_workers_that_share_nothing_publish_the_set(
    private_cluster: tuple[str, list[Path]], tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    address, worker_dirs = private_cluster
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.upload_faults = True
        r = run_cli(
            _env(hub, tmp_path),
            *_convert_args(tmp_path, "--push-to", TARGET, "--scheduler", address, "--quiet"),
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert "9 written" in r.stdout and "written by 2 processes" in r.stdout, r.stdout
        assert f"published to {TARGET}@main (check it: k3lab verify {TARGET})" in r.stdout, r.stdout
        # the next step from where the user stands: the folder holds no set, and says where it is
        here = run_cli(_env(hub, tmp_path), "verify", str(tmp_path / "out"))
        assert here.returncode == 2 and here.stderr.strip().splitlines() == [
            f"k3lab: error: {tmp_path / 'out'}: holds none of the set's 11 files: they were published to "
            f"{TARGET}@main and not kept here (--keep-local keeps them); check them there: k3lab verify {TARGET}"
        ], here.stderr
        there = run_cli(_env(hub, tmp_path), "verify", TARGET)
        assert there.returncode == 0 and "verify OK: 11 files" in there.stdout, there.stdout + there.stderr
        # the repo holds the set, byte for byte the local conversion's
        pushed = _repo_ggufs(hub)
        singles = ["Kimi-K3-tokenizer.gguf", "mmproj-Kimi-K3-BF16.gguf"]  # made by the client, beside the set
        assert sorted(pushed) == sorted([p.name for p in tiny_out.glob("*.gguf")] + singles)
        for name, data in pushed.items():
            if name not in singles:
                assert data == (tiny_out / name).read_bytes(), name
        files = hub.files_of(TARGET)
        assert {"MANIFEST.json", "README.md", "TENSOR_MAP.md"} <= set(files)
        card = files["README.md"].decode()
        assert card.startswith("---\nbase_model: moonshotai/Kimi-K3\n") and "- kimi-k3\n" in card
        assert f"hf download {TARGET}" in card and "Kimi-K3-MXFP4-00001-of-00009.gguf" in card
        assert f"k3lab convert --repo moonshotai/Kimi-K3 --revision {hub.first}" in card
        assert "`kimi-k3.block_count`" in card
        manifest = json.loads(files["MANIFEST.json"])
        made_here = {n: "git-" + git_blob_id(files[n]) for n in ("README.md", "TENSOR_MAP.md")}
        assert manifest["published"] == {"repo": TARGET, "branch": "main", "made": made_here}
        import hashlib

        for rec in manifest["files"]:
            assert rec["sha256"] == hashlib.sha256(pushed[rec["file"]]).hexdigest()
        # nothing was shared but the Hub: the client's folder holds no set, the workers' hold none now
        assert not list((tmp_path / "out").glob("*.gguf"))
        made = [d for d in worker_dirs if list(d.glob("**/k3lab/out-*/.k3lab/0*.json"))]
        assert len(made) == 2  # both workers converted into folders of their own
        assert not [p for d in worker_dirs for p in d.rglob("*.gguf")]
        assert not [p for d in worker_dirs for p in d.rglob("k3lab-dl-*") if p.is_dir()]
        local = json.loads((tmp_path / "out" / "MANIFEST.json").read_text())
        assert local["published"] == {
            "repo": TARGET,
            "branch": "main",
            "made": made_here,
            "commit": hub.repos[TARGET][1]["main"],
        }
        _no_token_on_disk(tmp_path, *worker_dirs)

        # a second run uploads nothing and commits nothing
        puts, commits = len(hub.uploads), len(hub.commit_log)
        again = run_cli(
            _env(hub, tmp_path),
            *_convert_args(tmp_path, "--push-to", TARGET, "--scheduler", address, "--quiet"),
        )
        assert again.returncode == 0, again.stderr[-3000:]
        assert "0 written, 9 already complete" in again.stdout
        assert (len(hub.uploads), len(hub.commit_log)) == (puts, commits)

        # k3lab verify on a snapshot of the repo
        snap = _snapshot(hub, tmp_path, tmp_path / "snap")
    v = subprocess.run(
        [sys.executable, "-m", "k3lab.cli", "verify", str(snap), "--quiet"], capture_output=True, text=True
    )
    assert v.returncode == 0 and "verify OK: 11 files" in v.stdout, v.stdout + v.stderr


@needs_llama
def test_llama_cpp_loads_the_set_downloaded_from_the_repo(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    out = tmp_path / "local"
    shutil.copytree(tiny_out, out)
    with HubServer(tiny_src, token=TOKEN) as hub:
        assert run_cli(_env(hub, tmp_path), "publish", str(out), TARGET).returncode == 0
        snap = _snapshot(hub, tmp_path, tmp_path / "snap")
    from llama_cpp import Llama

    llm = Llama(str(next(snap.glob("*-00001-of-*.gguf"))), n_ctx=64, verbose=False)
    assert llm.n_vocab() > 0
    out_tokens = llm.create_completion("Hello", max_tokens=4, temperature=0.0)
    assert out_tokens["choices"][0]["text"] is not None


def test_a_killed_publishing_run_uploads_only_the_rest(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """Commits as files arrive (--commit-every 0): a run killed (SIGKILL) after three commits keeps
    them; the rerun converts and uploads only the files not committed, and no blob is sent twice."""
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.throttle = 200_000
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "k3lab.cli",
                *_convert_args(tmp_path, "--push-to", TARGET, "--commit-every", "0", "--quiet"),
            ],
            env=_env(hub, tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while len([c for c in hub.commit_log if c[0] == TARGET]) < 3:
            time.sleep(0.05)
            assert run.poll() is None, run.communicate()
        run.kill()
        run.communicate()
        time.sleep(1.0)  # a commit the Hub was receiving as the run died lands now, or never
        committed = set(_repo_ggufs(hub))
        assert 3 <= len(committed) < 9
        hub.throttle = None
        before = len(hub.commit_log)
        again = run_cli(_env(hub, tmp_path), *_convert_args(tmp_path, "--push-to", TARGET, "--quiet"))
        assert again.returncode == 0, again.stderr[-2000:]
        # committed files are kept; a file the killed run had finished but not committed is kept too
        # (its local copy and record prove it), and uploaded now, without converting it again
        written, kept = map(int, re.search(r"(\d+) written, (\d+) already complete", again.stdout).groups())
        assert written + kept == 9 and len(committed) <= kept <= len(committed) + 1, (again.stdout, committed)
        later = {
            p
            for repo, _, paths in hub.commit_log[before:]
            if repo == TARGET
            for p in paths
            if p.endswith(".gguf")
        }
        singles = {"Kimi-K3-tokenizer.gguf", "mmproj-Kimi-K3-BF16.gguf"}
        assert later == set(p.name for p in tiny_out.glob("*.gguf")) - committed | singles
        assert len(hub.uploads) == len(set(hub.uploads))  # every file stored once
        for name, data in _repo_ggufs(hub).items():
            if name not in singles:
                assert data == (tiny_out / name).read_bytes(), name


def test_publish_pushes_a_local_set_once_and_refuses_another(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """The set with its mmproj and standalone tokenizer GGUF goes up once; a second publish sends and
    commits nothing; another set is refused, then replaces it with --force."""
    from k3lab.cli import main

    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    assert main(["vision", "--meta", str(tiny_src), "--out", str(out / "mmproj-Kimi-K3-BF16.gguf")]) == 0
    assert main(["tokenizer", "--meta", str(tiny_src), "--out", str(out / "Kimi-K3-tokenizer.gguf")]) == 0
    with HubServer(tiny_src, token=TOKEN) as hub:
        r = run_cli(_env(hub, tmp_path), "publish", str(out), TARGET)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.startswith("11 uploaded, 0 already in "), r.stdout
        files = hub.files_of(TARGET)
        for name in ("mmproj-Kimi-K3-BF16.gguf", "Kimi-K3-tokenizer.gguf"):
            assert files[name] == (out / name).read_bytes()
            assert f"`{name}`" in files["README.md"].decode()
        for name, data in _repo_ggufs(hub).items():
            assert data == (out / name).read_bytes(), name
        puts, commits = len(hub.uploads), len(hub.commit_log)
        r = run_cli(_env(hub, tmp_path), "publish", str(out), TARGET)
        assert (
            r.returncode == 0
            and r.stdout.startswith("0 uploaded, 11 already in ")
            and "nothing to commit" in r.stdout
        )
        assert (len(hub.uploads), len(hub.commit_log)) == (puts, commits)
        # another set (another name) is refused, then replaces it with --force
        other = tmp_path / "other"
        from conftest import convert

        assert convert(tiny_src, other, "--name", "Other") == 0
        r = run_cli(_env(hub, tmp_path), "publish", str(other), TARGET)
        assert (
            r.returncode == 2 and "holds another set" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        )
        assert (len(hub.uploads), len(hub.commit_log)) == (puts, commits)
        r = run_cli(_env(hub, tmp_path), "publish", str(other), TARGET, "--force")
        assert r.returncode == 0, r.stderr
        assert sorted(n for n in _repo_ggufs(hub) if "-of-" in n) == sorted(
            p.name for p in other.glob("*.gguf")
        )
    _no_token_on_disk(out, other)


def test_a_moved_source_replaces_exactly_its_file_in_the_repo(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """The source repo changes one shard after a run published to a branch with --keep-local: the
    rerun converts and uploads that file only, and the branch's copy is replaced (the set is the new
    commit's); main is never touched and the local copies stay."""
    index = json.loads((tiny_src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["language_model.model.layers.2.input_layernorm.weight"]
    to_branch = ("--push-branch", "v1", "--keep-local", "--text-only")
    with HubServer(tiny_src, token=TOKEN) as hub:
        assert (
            run_cli(
                _env(hub, tmp_path), *_convert_args(tmp_path, "--push-to", TARGET, "--quiet", *to_branch)
            ).returncode
            == 0
        )
        before = _repo_ggufs(hub, branch="v1")
        assert sorted(before) == sorted(p.name for p in tiny_out.glob("*.gguf")) and not _repo_ggufs(hub)
        assert sorted(p.name for p in (tmp_path / "out").glob("*.gguf")) == sorted(before)
        raw = bytearray(hub.file(shard))
        raw[-3] ^= 0xFF
        hub.commit({shard: bytes(raw)}, "change a shard")
        puts, commits = len(hub.uploads), len(hub.commit_log)
        r = run_cli(_env(hub, tmp_path), *_convert_args(tmp_path, "--push-to", TARGET, "--quiet", *to_branch))
        assert r.returncode == 0, r.stderr[-2000:]
        assert "1 written, 8 already complete" in r.stdout, r.stdout
        after = _repo_ggufs(hub, branch="v1")
        changed = sorted(n for n in after if after[n] != before[n])
        assert len(changed) == 1 and len(hub.uploads) == puts + 1 and len(hub.commit_log) == commits + 1
        assert {p for p in hub.commit_log[-1][2] if p.endswith(".gguf")} == {changed[0]}
        assert after[changed[0]] != (tiny_out / changed[0]).read_bytes()
        assert after[changed[0]] == (tmp_path / "out" / changed[0]).read_bytes() and not _repo_ggufs(hub)


def test_a_repo_whose_manifest_is_not_k3labs_is_one_line(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """The target repo is a stranger's: a MANIFEST.json that is not a k3lab manifest (or a record
    claiming another file's number) is one line, and nothing is uploaded."""
    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.repos[TARGET] = ({}, {})
        hub._new_commit(
            {"MANIFEST.json": b'{"files": [{"format": "k3lab-manifest/2", "file": "../x"}]}'}, "x", TARGET
        )
        r = run_cli(_env(hub, tmp_path), "publish", str(out), TARGET)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "MANIFEST.json: not a k3lab manifest" in lines[0], lines
        assert not hub.uploads


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--push-branch", "dev"], "--push-branch is for publishing: it needs --push-to"),
        (["--keep-local"], "--keep-local is for publishing: it needs --push-to"),
        (["--push-to", "just-a-name"], "argument --push-to: 'just-a-name' is not a Hub repo: give ORG/NAME"),
        (["--push-to", "org/"], "argument --push-to: 'org/' is not a Hub repo: give ORG/NAME"),
    ],
)
def test_publishing_flags_without_a_repo_are_one_line_and_write_nothing(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], needle: str
) -> None:
    from k3lab.cli import main

    out = tmp_path / "out"
    code = main(["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--quiet", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_a_published_file_is_read_once_after_it_is_written(
    tiny_src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole file's SHA-256 is made as the file is written: the upload is the only read of a
    finished file (every byte once, counted where huggingface_hub reads the operation's file), and
    huggingface_hub never reads one to hash it."""
    import huggingface_hub.lfs
    from huggingface_hub import constants

    from k3lab import request
    from k3lab.pipeline.publishing import upload as uploading

    read: dict[str, int] = {}
    real = uploading._Reading.readinto

    def counted(self, buffer):  # type: ignore[no-untyped-def]
        n = real(self, buffer)
        read[Path(self.fh.name).name] = read.get(Path(self.fh.name).name, 0) + n
        return n

    def no_hashing(fileobj):  # type: ignore[no-untyped-def]
        raise AssertionError(f"{getattr(fileobj, 'name', fileobj)} read to be hashed")

    monkeypatch.setattr(uploading._Reading, "readinto", counted)
    monkeypatch.setattr(huggingface_hub.lfs, "sha_fileobj", no_hashing)
    with HubServer(tiny_src, token=TOKEN) as hub:
        for k, v in _env(hub, tmp_path).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(
            constants, "HF_HUB_DISABLE_XET", True
        )  # (read at import: the loopback Hub speaks LFS)
        req = request.Request(
            meta=str(tiny_src),
            out_dir=str(tmp_path / "out"),
            push_to=TARGET,
            quiet=True,
            text_only=True,
            split_max_tensors=1,
        )
        results = request.convert(req)
        sizes = {n: len(d) for n, d in _repo_ggufs(hub).items()}
    assert len(results) == 9 and len(sizes) == 9
    assert read == sizes  # each file read once, by its upload, whole


def _ride_out(hub: HubServer, tmp_path: Path, args: list[str], seconds: float) -> subprocess.CompletedProcess:
    """Run k3lab; once uploads are under way (its first pre-upload asked), the Hub goes down for
    ``seconds``."""
    before = len([r for r in hub.requests if "/preupload/" in r[1]])
    run = subprocess.Popen(
        [sys.executable, "-m", "k3lab.cli", *args],
        env=_env(hub, tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while len([r for r in hub.requests if "/preupload/" in r[1]]) == before:
        time.sleep(0.02)
        assert run.poll() is None, run.communicate()
    hub.outage(seconds)
    out, err = run.communicate(timeout=seconds + 600)
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


@pytest.mark.slow  # (a minute of the suite; it keeps a minute-long outage of downloads on Dask)
def test_uploads_ride_out_an_outage_longer_than_huggingface_hubs_retries(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """The Hub down for 35 s while files upload (huggingface_hub gives up on its own after ~20 s):
    the run rides it out within the retry budget, exit 0, the set complete and byte-identical, and
    none of huggingface_hub's retry lines on the terminal."""
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.throttle = 300_000
        r = _ride_out(
            hub, tmp_path, _convert_args(tmp_path, "--push-to", TARGET, "--quiet", "--text-only"), 35
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr == "" and r.stdout.count("\n") == 1, (r.stdout, r.stderr)
        assert hub.dropped > 0
        for name, data in _repo_ggufs(hub).items():
            assert data == (tiny_out / name).read_bytes(), name
        assert len(_repo_ggufs(hub)) == 9


@pytest.mark.slow
def test_a_three_minute_outage_during_uploads_on_dask_and_publish(
    private_cluster: tuple[str, list[Path]], tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """A real scheduler and workers that share nothing: the Hub down for 3 minutes while files
    upload; the run finishes within the default budget, the set complete and byte-identical; and
    `k3lab publish` of a local set the same."""
    address, _ = private_cluster
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.throttle = 300_000
        args = _convert_args(tmp_path, "--push-to", TARGET, "--scheduler", address, "--quiet")
        r = _ride_out(hub, tmp_path, args, 180)
        assert r.returncode == 0, r.stderr[-3000:]
        for name in (p.name for p in tiny_out.glob("*.gguf")):
            assert _repo_ggufs(hub)[name] == (tiny_out / name).read_bytes(), name
        out = tmp_path / "set"
        shutil.copytree(tiny_out, out)
        p = _ride_out(hub, tmp_path, ["publish", str(out), "k3lab-test/Published"], 180)
        assert p.returncode == 0, p.stderr[-3000:]
        assert sorted(_repo_ggufs(hub, "k3lab-test/Published")) == sorted(
            x.name for x in tiny_out.glob("*.gguf")
        )


@needs_llama
def test_variants_made_on_workers_that_share_nothing_are_published_in_their_folders(
    private_cluster: tuple[str, list[Path]], tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """``convert --variants`` on two Dask workers with folders of their own: each worker quantises the
    file it converted, from its own disk, and uploads both into the repo (the variant into its folder);
    the imatrix is read from the Hub by ranges. The repo's variant files are byte for byte those of a
    local ``k3lab quantize``; a snapshot of a variant folder verifies; a second run uploads nothing;
    ``k3lab quantize --push-to`` adds another variant, and the card lists both with their commands."""
    address, worker_dirs = private_cluster
    imatrix = Path(__file__).resolve().parent.parent / "data" / "imatrix-tiny.gguf"
    (tmp_path / "im").mkdir()
    shutil.copy(imatrix, tmp_path / "im" / "imatrix.gguf")
    local = tmp_path / "local"
    shutil.copytree(tiny_out, local)
    # (run beside the imatrix: llama-quantize records the path it was given, here the Hub's path too)
    made = run_cli(None, "quantize", str(local), "--type", "IQ2_XXS,MoE-Q2_K", "--imatrix", "imatrix.gguf", "--quiet",
                   cwd=tmp_path / "im")  # fmt: skip
    assert made.returncode == 0, made.stderr
    with HubServer(tiny_src, token=TOKEN) as hub:
        hub.add_repo("k3lab-test/imatrices", tmp_path / "im")
        env = _env(hub, tmp_path)
        # a local imatrix cannot reach workers that share nothing: one line, nothing written
        r = run_cli(env, *_convert_args(tmp_path, "--push-to", TARGET, "--scheduler", address, "--variants", "IQ2_XXS",
                                        "--imatrix", str(tmp_path / "im" / "imatrix.gguf")))  # fmt: skip
        assert r.returncode == 2 and "give ORG/NAME:PATH" in r.stderr and not (tmp_path / "out").exists()
        args = ("--push-to", TARGET, "--scheduler", address, "--variants", "IQ2_XXS", "--imatrix",
                "k3lab-test/imatrices:imatrix.gguf", "--quiet")  # fmt: skip
        r = run_cli(env, *_convert_args(tmp_path, *args))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "IQ2_XXS: 9 written" in r.stdout, r.stdout
        files = hub.files_of(TARGET)
        theirs = {
            p.split("/")[1]: d for p, d in files.items() if p.startswith("IQ2_XXS/") and p.endswith(".gguf")
        }
        mine = {p.name: p.read_bytes() for p in (local / "IQ2_XXS").glob("*.gguf")}
        assert len(mine) == 9 and theirs == mine
        assert "IQ2_XXS/MANIFEST.json" in files and ".gguf" not in str(
            [p for d in worker_dirs for p in d.rglob("*.gguf")]
        )
        puts = len(hub.uploads)
        again = run_cli(env, *_convert_args(tmp_path, *args))
        assert again.returncode == 0 and "IQ2_XXS: 0 written, 9 already complete" in again.stdout, (
            again.stdout
        )
        assert len(hub.uploads) == puts
        # another variant, from the local set, into the same repo
        q = run_cli(
            env, "quantize", str(local), "--type", "MoE-Q2_K", "--imatrix", "imatrix.gguf", "--push-to", TARGET,
            "--keep-local", "--quiet", cwd=tmp_path / "im",
        )  # fmt: skip  # (the request it was made as: the same imatrix)
        assert q.returncode == 0, q.stderr[-3000:]
        files = hub.files_of(TARGET)
        pushed = {p for p in files if p.startswith("MoE-Q2_K/")}
        assert pushed == {f"MoE-Q2_K/{p.name}" for p in (local / "MoE-Q2_K").glob("*.gguf")} | {
            "MoE-Q2_K/MANIFEST.json"
        }
        for p in pushed - {"MoE-Q2_K/MANIFEST.json"}:
            assert files[p] == (local / p).read_bytes(), p
        card = files["README.md"].decode()
        assert (
            "## Quantised variants" in card and "| `IQ2_XXS` | 9 |" in card and "| `MoE-Q2_K` | 9 |" in card
        )
        assert "llama-quantize --keep-split --allow-requantize --imatrix imatrix.gguf --tensor-type" in card
        assert json.loads(files["MoE-Q2_K/MANIFEST.json"])["made_as"].startswith(
            "llama-quantize --keep-split"
        )
        # k3lab quantize on the cluster (the set's folder shared: here one machine's), the same bytes
        shutil.copytree(local, tmp_path / "shared", ignore=shutil.ignore_patterns("IQ2_XXS", "MoE-Q2_K"))
        d = run_cli(
            None,
            "quantize",
            str(tmp_path / "shared"),
            "--type",
            "MoE-Q2_K",
            "--scheduler",
            address,
            "--quiet",
        )
        assert d.returncode == 0 and "MoE-Q2_K: 9 written" in d.stdout, d.stdout + d.stderr
        here = tmp_path / "here"  # (the same request in one process)
        shutil.copytree(local, here, ignore=shutil.ignore_patterns("IQ2_XXS", "MoE-Q2_K"))
        assert run_cli(None, "quantize", str(here), "--type", "MoE-Q2_K", "--quiet").returncode == 0
        assert not _same_files(tmp_path / "shared" / "MoE-Q2_K", here / "MoE-Q2_K")
        there = run_cli(env, "verify", f"{TARGET}/IQ2_XXS", "--all")
        assert there.returncode == 0 and "verify OK: 9 files" in there.stdout, there.stdout + there.stderr
        assert run_cli(env, "verify", TARGET).returncode == 0  # (the set at the top, its variants apart)
        hub.corrupt.add("IQ2_XXS/Kimi-K3-IQ2_XXS-00004-of-00009.gguf")
        bad = run_cli(env, "verify", f"{TARGET}/IQ2_XXS", "--all")
        assert bad.returncode == 1 and "Kimi-K3-IQ2_XXS-00004-of-00009.gguf" in bad.stdout + bad.stderr
        hub.corrupt.clear()
        snap = _snapshot(hub, tmp_path, tmp_path / "snap")
    v = subprocess.run([sys.executable, "-m", "k3lab.cli", "verify", str(snap / "IQ2_XXS"), "--quiet"],
                       capture_output=True, text=True)  # fmt: skip
    assert v.returncode == 0 and "verify OK: 9 files" in v.stdout, v.stdout + v.stderr
    _no_token_on_disk(tmp_path, *worker_dirs)


def _same_files(a: Path, b: Path) -> list[str]:
    """The GGUF files of ``a`` and ``b`` that differ (or are on one side only)."""
    names = {p.name for p in a.glob("*.gguf")} | {p.name for p in b.glob("*.gguf")}
    return sorted(
        n
        for n in names
        if not ((a / n).is_file() and (b / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes())
    )


@needs_llama
def test_a_failed_first_publish_of_a_variant_commits_nothing(
    tiny_src: Path, tiny_out: Path, tmp_path: Path
) -> None:
    """Every file of a first published run fails (here the one asked for: its lossless file changed
    under its record): no commit reaches the repo (no manifest of nothing); the run says why in one line."""
    import os

    from k3lab.pipeline.state import OutputFolder

    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    path = out / "Kimi-K3-MXFP4-00005-of-00009.gguf"
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    folder = OutputFolder(out)
    rec = folder.records.text(5)
    rec.identity = {**rec.identity, "ino": path.stat().st_ino}  # (as if this were the file written)
    folder.records.write(rec)
    with HubServer(tiny_src, token=TOKEN) as hub:
        r = run_cli(_env(hub, tmp_path), "quantize", str(out), "--type", "Q8_0", "--files", "5", "--push-to",
                    TARGET, "--quiet")  # fmt: skip
        assert r.returncode == 2, r.stderr[-2000:]
        assert "not the ones its record hashed" in r.stderr
        assert [c for c in hub.commit_log if c[0] == TARGET] == []
