"""Trust nothing unproven: one test per class of hostile or broken input and per write point of the
folder's state. Every case runs on a checkpoint drawn differently from synth's default (another
seed, plain random weights, other expert counts), and asserts the exit code, one line naming the
file, no traceback, nothing outside OUT changed (a sentinel tree hashed before and after), and a
clean rerun byte-identical to a clean run."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_edits import KILL_AT, read_tensors, write_tensors
from conftest import PER_LAYER

from k3lab.cli import main
from k3lab.kimi_k3.synth import synthesize

K3LAB = [sys.executable, "-m", "k3lab.cli"]
INDEX = "model.safetensors.index.json"
PLAN, KVS = ".k3lab/plan.json", ".k3lab/kvs.json"


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny, but seed 11, plain normal weights and 4 experts: not the values synth's tests see."""
    src = tmp_path_factory.mktemp("drawn") / "src"
    synthesize("tiny", src, seed=11, experts=4, draw="normal")
    return src


@pytest.fixture(scope="module")
def clean(drawn: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every file of a clean conversion of ``drawn``, by name (the state included)."""
    out = tmp_path_factory.mktemp("clean")
    assert _convert(drawn, out) == 0
    return _outputs(out)


@pytest.fixture
def sentinel(tmp_path: Path) -> Callable[[], dict[str, str]]:
    """A tree outside OUT that hostile links point into; returns a function hashing it."""
    root = tmp_path / "sentinel"
    (root / "sub").mkdir(parents=True)
    (root / "precious.txt").write_bytes(b"a user's file\n" * 100)
    (root / "sub" / "notes.md").write_text("keep me\n")
    (root / "model.gguf").write_bytes(os.urandom(4096))

    def digest() -> dict[str, str]:
        return {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    digest.root = root  # type: ignore[attr-defined]
    return digest


def _convert(src: Path, out: Path, *extra: str) -> int:
    """A layer per file (the folder remembers it: a later run without the flag keeps it)."""
    return main(["convert", "--meta", str(src), "--out-dir", str(out), "--quiet", *PER_LAYER, *extra])


def _outputs(out: Path) -> dict[str, bytes]:
    """The set's files and the manifest (what a user keeps)."""
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.gguf"))} | {
        "MANIFEST.json": (out / "MANIFEST.json").read_bytes()
    }


def _one_line(capsys: pytest.CaptureFixture, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _layer_file(src: Path, layer: int) -> str:
    index = json.loads((src / INDEX).read_text())["weight_map"]
    return index[f"language_model.model.layers.{layer}.input_layernorm.weight"]


def _kda_layer(src: Path) -> int:
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    full = set(cfg["linear_attn_config"]["full_attn_layers"])
    return next(i for i in range(cfg["num_hidden_layers"]) if i + 1 not in full and i not in full)


# --- 1. nothing outside the folder -----------------------------------------------------------------


def test_a_symlinked_lock_is_refused_and_its_target_untouched(
    drawn: Path, tmp_path: Path, sentinel: Callable, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    (out / ".k3lab").mkdir(parents=True)
    (out / ".k3lab" / "lock").symlink_to(sentinel.root / "precious.txt")  # type: ignore[attr-defined]
    before = sentinel()
    assert _convert(drawn, out) == 2
    _one_line(capsys, "lock", "symlink")
    assert sentinel() == before
    (out / ".k3lab" / "lock").unlink()
    assert _convert(drawn, out) == 0


def test_a_symlinked_state_folder_is_refused(
    drawn: Path, tmp_path: Path, sentinel: Callable, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".k3lab").symlink_to(sentinel.root, target_is_directory=True)  # type: ignore[attr-defined]
    before = sentinel()
    assert _convert(drawn, out) == 2
    _one_line(capsys, ".k3lab", "symlink")
    assert sentinel() == before and not list(out.glob("*.gguf"))


def test_a_symlinked_partial_is_never_written_through(
    drawn: Path, tmp_path: Path, sentinel: Callable, clean: dict[str, bytes]
) -> None:
    """A stranger's ``NAME.gguf.partial`` symlink: k3lab's cleanup leaves the link (not its own) and
    its target alone, and the file is written beside it, never through it."""
    out = tmp_path / "out"
    out.mkdir()
    first = next(n for n in clean if n.endswith("00001-of-00009.gguf"))
    link = out / (first + ".partial")
    link.symlink_to(sentinel.root / "model.gguf")  # type: ignore[attr-defined]
    before = sentinel()
    code = _convert(drawn, out)
    assert sentinel() == before
    assert link.is_symlink(), "k3lab removed a file it did not make"
    assert code == 2  # one line naming the partial (see below); the other files are converted
    link.unlink()
    assert _convert(drawn, out) == 0
    assert _outputs(out) == clean


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/abs-k3lab", "sub/dir", "..", ".hidden", "a\nb"])
def test_name_is_a_plain_basename(
    drawn: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "deep" / "er" / "out"
    assert _convert(drawn, out, "--name", name) == 2
    _one_line(capsys, "--name", "plain name")
    assert not (tmp_path / "deep").exists()
    assert not list(Path("/tmp").glob("abs-k3lab*"))


@pytest.mark.parametrize(
    "entry",
    [
        "ABS",
        "../model-00001-of-000011.safetensors",
        "a/../../x.safetensors",
        "x\x00.safetensors",
        "x\n.safetensors",
    ],
)
def test_an_index_naming_a_file_outside_the_source_is_refused(
    drawn: Path, tmp_path: Path, sentinel: Callable, entry: str, capsys: pytest.CaptureFixture
) -> None:
    src = _copy(drawn, tmp_path / "src")
    target = sentinel.root / "precious.txt"  # type: ignore[attr-defined]
    index = json.loads((src / INDEX).read_text())
    name = next(k for k in index["weight_map"] if "layers.1." in k)
    index["weight_map"][name] = str(target) if entry == "ABS" else entry
    (src / INDEX).write_text(json.dumps(index))
    before = sentinel()
    assert _convert(src, tmp_path / "out") == 2
    line = _one_line(capsys, INDEX, name, "inside the checkpoint")
    assert "Traceback" not in line
    assert sentinel() == before and not (tmp_path / "out").exists()


def test_a_hub_source_deletes_only_what_it_downloaded(tmp_path: Path) -> None:
    from k3lab.pipeline.sources.hub import HubSource, hub_spec

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    mine = scratch / "model-00001-of-00002.safetensors"
    mine.write_bytes(b"a user's copy, found in scratch")
    source = HubSource(hub_spec(tmp_path, "org/name", scratch=scratch))
    source.release(mine.name)  # found there, not downloaded by this source: kept
    assert mine.read_bytes() == b"a user's copy, found in scratch"


# --- 2. wrong output never verifies ------------------------------------------------------------------


def _reshape(src: Path, file: str, name: str, shape: tuple[int, ...], data: bytes | None = None) -> None:
    ts = read_tensors(src / file)
    for t in ts:
        if t[0] == name:
            t[2] = shape
            if data is not None:
                t[3] = data
    write_tensors(src / file, ts)


def _shape_cases(src: Path) -> dict[str, Callable[[Path], str]]:
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    kda = _kda_layer(src)
    q = f"language_model.model.layers.{kda}.self_attn.q_proj.weight"
    emb = "language_model.model.embed_tokens.weight"
    norm = f"language_model.model.layers.{kda}.input_layernorm.weight"
    H = cfg["hidden_size"]

    def transposed_q(s: Path) -> str:  # same bytes, other shape: [d, H] given as [d/2, 2H]
        f = _layer_file(s, kda)
        rows = [t for t in read_tensors(s / f) if t[0] == q][0][2][0]
        _reshape(s, f, q, (rows // 2, 2 * H))
        return q

    def embed_rows(s: Path) -> str:
        index = json.loads((s / INDEX).read_text())["weight_map"]
        t = [t for t in read_tensors(s / index[emb]) if t[0] == emb][0]
        _reshape(s, index[emb], emb, (t[2][0] - 2, H), t[3][: (t[2][0] - 2) * H * 2])
        return emb

    def empty(s: Path) -> str:
        _reshape(s, _layer_file(s, kda), norm, (0, H), b"")
        return norm

    def huge_but_empty(s: Path) -> str:
        _reshape(s, _layer_file(s, kda), norm, (2**62, 2**62, 0), b"")
        return norm

    return {"transposed": transposed_q, "rows": embed_rows, "empty": empty, "overflow": huge_but_empty}


@pytest.mark.parametrize("case", ["transposed", "rows", "empty", "overflow"])
def test_a_shape_the_config_does_not_imply_is_refused_and_never_verifies(
    drawn: Path, tmp_path: Path, case: str, capsys: pytest.CaptureFixture, clean: dict[str, bytes]
) -> None:
    src = _copy(drawn, tmp_path / "src")
    name = _shape_cases(src)[case](src)
    assert _convert(src, tmp_path / "out") == 2
    _one_line(capsys, name, "expected")
    assert not (tmp_path / "out").exists()
    # a set converted from the good source does not verify against the bad one
    good = tmp_path / "good"
    assert _convert(drawn, good) == 0
    capsys.readouterr()
    assert main(["verify", str(good), "--src", str(src), "--quiet"]) != 0
    assert name in capsys.readouterr().err


def _tamper_plan(out: Path, keep_digest: bool) -> None:
    """One tensor's type BF16 -> F16 in plan.json; with ``keep_digest``, the state line recomputed
    too, as a careful forger would."""
    path = out / PLAN
    head, _, body = path.read_bytes().partition(b"\n")
    plan = json.loads(body)
    t = next(t for f in plan["files"] for t in f["tensors"] if t["type"] == "BF16")
    t["type"] = "F16"
    body = (json.dumps(plan, sort_keys=True) + "\n").encode()
    if keep_digest:
        magic, kind, _ = head.split(b" ")
        head = b" ".join([magic, kind, hashlib.sha256(body).hexdigest().encode()])
    path.write_bytes(head + b"\n" + body)


@pytest.mark.parametrize("keep_digest", [False, True])
def test_an_edited_plan_is_never_trusted(
    drawn: Path, tmp_path: Path, keep_digest: bool, clean: dict[str, bytes]
) -> None:
    out = tmp_path / "out"
    assert _convert(drawn, out) == 0
    _tamper_plan(out, keep_digest)
    assert _convert(drawn, out, "--force") == 0  # planned again from the inputs
    assert _outputs(out) == clean
    assert main(["verify", str(out), "--quiet"]) == 0


@pytest.mark.parametrize("forge", [False, True])
def test_a_plan_whose_bytes_changed_reads_as_absent(drawn: Path, tmp_path: Path, forge: bool) -> None:
    """One byte of the plan's config edited (a field no file digest covers); forged: with the state
    line's digest recomputed, so that only the comparison with config.json on disk catches it."""
    from k3lab.kimi_k3.model import MODEL
    from k3lab.pipeline.running.start import prepare
    from k3lab.pipeline.sources.base import SourceSpec
    from k3lab.pipeline.state import OutputFolder

    out = tmp_path / "out"
    assert _convert(drawn, out, "--shards", "1") == 0
    path = out / PLAN
    head, _, body = path.read_bytes().partition(b"\n")
    plan = json.loads(body)
    plan["config"]["text_config"]["qk_nope_head_dim"] += 1  # would split kv_b elsewhere
    body = (json.dumps(plan, sort_keys=True) + "\n").encode()
    if forge:
        magic, kind, _ = head.split(b" ")
        head = b" ".join([magic, kind, hashlib.sha256(body).hexdigest().encode()])
    path.write_bytes(head + b"\n" + body)
    loaded = OutputFolder(out).plans.load(MODEL)
    assert (loaded is None) != forge
    plan_now, kvs = prepare(MODEL, SourceSpec.local(drawn), out)
    assert kvs is not None, "the edited plan was reused"
    assert plan_now.cfg.raw == json.loads((drawn / "config.json").read_text())


def test_verify_refuses_records_the_folders_plan_contradicts(
    drawn: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A manifest whose tensor types were edited (and the file hashes kept) against the plan."""
    out = tmp_path / "out"
    assert _convert(drawn, out) == 0
    man = json.loads((out / "MANIFEST.json").read_text())
    t = next(t for r in man["files"] for t in r["tensors"] if t["type"] == "BF16")
    t["type"] = "F16"
    (out / "MANIFEST.json").write_text(json.dumps(man))
    capsys.readouterr()
    assert main(["verify", str(out), "--quiet"]) == 1
    assert f"tensor {t['name']}: recorded ('F16'" in capsys.readouterr().out


# --- 3. a folder is never stuck --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "content"),
    [
        (PLAN, b'{"format": "k3lab-plan/1"}\n'),
        (PLAN, b"k3lab-state/1 plan " + hashlib.sha256(b"{}\n").hexdigest().encode() + b"\n{}\n"),
        (KVS, b"\x00" * 100),
        (".k3lab/00003.json", b"[]"),
        (".k3lab/00003.json", os.urandom(300)),
        (
            ".k3lab/00001.json",
            b"k3lab-state/1 record " + hashlib.sha256(b"[]\n").hexdigest().encode() + b"\n[]\n",
        ),
    ],
)
def test_damaged_state_reads_as_absent_and_the_work_is_redone(
    drawn: Path, tmp_path: Path, path: str, content: bytes, clean: dict[str, bytes], capsys
) -> None:
    out = tmp_path / "out"
    assert _convert(drawn, out) == 0
    (out / path).write_bytes(content)
    capsys.readouterr()
    assert _convert(drawn, out) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert _outputs(out) == clean
    assert main(["verify", str(out), "--quiet"]) == 0


def _count_replaces(drawn: Path, out: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> int:
    calls = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b, **kw: (calls.append(b), real(a, b, **kw))[1])
    assert _convert(drawn, out, *extra) == 0
    monkeypatch.setattr(os, "replace", real)
    return len(calls)


def test_a_failure_at_every_write_point_leaves_a_folder_the_next_run_finishes(
    drawn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: dict[str, bytes]
) -> None:
    """Every rename of a run (KVs, plan, each file, each record, the manifest) fails in turn with
    EIO; the next run finishes, byte-identical to a clean run."""
    n = _count_replaces(drawn, tmp_path / "count", monkeypatch)
    assert n >= 2 * 9 + 3
    real = os.replace
    for point in range(1, n + 1):
        out = tmp_path / f"out{point}"
        seen = [0]

        def failing(a: str, b: str, point: int = point, seen: list = seen, **kw: object) -> None:
            seen[0] += 1
            if seen[0] == point:
                raise OSError(5, "Input/output error (injected)")
            real(a, b, **kw)

        monkeypatch.setattr(os, "replace", failing)
        assert _convert(drawn, out) != 0, point
        monkeypatch.setattr(os, "replace", real)
        assert _convert(drawn, out) == 0, point
        assert _outputs(out) == clean, point
        assert not list(out.rglob("*.partial")), point


def test_kill_9_between_any_two_writes_leaves_a_folder_the_next_run_finishes(
    drawn: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: dict[str, bytes]
) -> None:
    """kill -9 before each kind of write (the KVs, the plan, a file, its record, a file between two
    others, the manifest), after an option change the next run undoes: the folder is never stuck."""
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert _convert(drawn, tmp_path / "count", "--shards", "2") == 0
    n = _count_replaces(drawn, tmp_path / "count", monkeypatch, "--chat-template", str(template))
    for point in (1, 2, 3, 4, 5, n // 2, n):
        out = tmp_path / f"out{point}"
        assert _convert(drawn, out, "--shards", "2") == 0  # a folder with state of other options
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                KILL_AT,
                str(point),
                "convert",
                "--meta",
                str(drawn),
                "--out-dir",
                str(out),
                "--quiet",
                "--chat-template",
                str(template),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == -signal.SIGKILL, (point, proc.stderr)
        assert _convert(drawn, out) == 0, point  # back to the first options: nothing to delete by hand
        assert _outputs(out) == clean, point


# --- 4. hangs and unbounded work ---------------------------------------------------------------------


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*K3LAB, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tiktoken.model", INDEX])
def test_a_fifo_for_an_input_is_one_line_not_a_hang(drawn: Path, tmp_path: Path, name: str) -> None:
    src = _copy(drawn, tmp_path / "src")
    (src / name).unlink()
    os.mkfifo(src / name)
    t0 = time.monotonic()
    proc = _run(["convert", "--meta", str(src), "--out-dir", str(tmp_path / "out"), "--quiet"])
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and name in proc.stderr and "FIFO" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_fifo_manifest_is_one_line_not_a_hang(drawn: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _convert(drawn, out) == 0
    (out / "MANIFEST.json").unlink()
    os.mkfifo(out / "MANIFEST.json")
    proc = _run(["verify", str(out), "--quiet"])
    assert proc.returncode == 1 and "MANIFEST.json: is a FIFO" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_manifest_claiming_a_billion_files_is_bounded_work(drawn: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _convert(drawn, out) == 0
    man = json.loads((out / "MANIFEST.json").read_text())
    for r in man["files"]:
        r["split_count"] = 10**9
    (out / "MANIFEST.json").write_text(json.dumps(man))
    t0 = time.monotonic()
    proc = _run(["verify", str(out), "--quiet"])
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1
    assert len(proc.stdout.splitlines()) < 50, proc.stdout[:2000]
    assert "claims 1000000000 split files but lists 9" in proc.stdout


# --- 5. other commands never write over the set -------------------------------------------------------


@pytest.mark.parametrize("command", ["vision", "tokenizer"])
@pytest.mark.parametrize("target", ["split", "MANIFEST.json", ".k3lab/x.gguf", "notes.txt"])
def test_vision_and_tokenizer_refuse_a_name_of_the_set(
    drawn: Path, tmp_path: Path, command: str, target: str, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert _convert(drawn, out) == 0
    before = _outputs(out)
    name = next(n for n in before if n.endswith("00002-of-00009.gguf")) if target == "split" else target
    capsys.readouterr()
    assert main([command, "--meta", str(drawn), "--out", str(out / name)]) == 2
    _one_line(capsys, name.split("/")[-1])
    assert _outputs(out) == before
    assert main(["verify", str(out), "--quiet"]) == 0


# --- 6. the noisy cases: one line each -----------------------------------------------------------------


def test_tiktoken_pointing_at_dev_zero_is_one_line(drawn: Path, tmp_path: Path, capsys) -> None:
    src = _copy(drawn, tmp_path / "src")
    (src / "tiktoken.model").unlink()
    (src / "tiktoken.model").symlink_to("/dev/zero")
    assert _convert(src, tmp_path / "out") == 2
    _one_line(capsys, "tiktoken.model", "a device")


def test_a_shard_pointing_into_proc_is_one_line_naming_it(drawn: Path, tmp_path: Path, capsys) -> None:
    src = _copy(drawn, tmp_path / "src")
    shard = src / _layer_file(src, 1)
    shard.unlink()
    shard.symlink_to("/proc/self/mem")
    assert _convert(src, tmp_path / "out") == 2
    _one_line(capsys, shard.name)
    assert not (tmp_path / "out").exists()


def test_shards_out_of_range_creates_nothing(drawn: Path, tmp_path: Path, capsys) -> None:
    assert _convert(drawn, tmp_path / "out", "--shards", "99") == 2
    _one_line(capsys, "--files", "99")
    assert not (tmp_path / "out").exists()


def test_duplicate_keys_in_a_header_are_refused(drawn: Path, tmp_path: Path, capsys) -> None:
    src = _copy(drawn, tmp_path / "src")
    shard = src / _layer_file(src, 1)
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + n].rstrip()
    first = json.loads(header)
    name = next(k for k in first if k != "__metadata__")
    dup = header[:-1] + b"," + json.dumps({name: first[name]}).encode()[1:]
    dup += b" " * (-len(dup) % 8)
    shard.write_bytes(struct.pack("<Q", len(dup)) + dup + raw[8 + n :])
    assert _convert(src, tmp_path / "out") == 2
    _one_line(capsys, shard.name, name, "twice")


def test_a_worker_killed_by_the_os_is_one_line_and_finished_files_are_kept(
    tmp_path: Path, clean: dict[str, bytes], drawn: Path
) -> None:
    """As the OOM killer would: SIGKILL to a --jobs worker mid-conversion."""
    import psutil

    src = tmp_path / "layer"
    synthesize("layer", src, seed=3, experts=4)  # seed 3 (plain random draws of this size take 40 s)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [*K3LAB, "convert", "--meta", str(src), "--out-dir", str(out), "--quiet", "--jobs", "2", *PER_LAYER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        for worker in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error):  # the worker writing a .partial: mid-conversion
                if any(f.path.endswith(".gguf.partial") for f in worker.open_files()):
                    victim = worker
                    victim.send_signal(signal.SIGKILL)
                    break
        time.sleep(0.01)
    assert victim is not None, proc.communicate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "worker for output file " in lines[0] and "died (signal 9)" in lines[0], err
    assert _convert(src, out) == 0
    assert main(["verify", str(out), "--quiet"]) == 0
