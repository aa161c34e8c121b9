"""The published repo as a person meets it: the repo downloaded with huggingface_hub as the card says,
the card parsed by huggingface_hub's ModelCard and its metadata checked against the Hub's spec, every
shell and Python block of the card that needs no GPU run verbatim from a fresh folder, every file it
names in the repo, no path of the maker's anywhere; the seed kit's own check of a manifest, as it
documents it, on a local set and on a download; --private and --push-branch against a Hub that
enforces them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from hub_server import HubServer

SOURCE = "moonshotai/Kimi-K3"
TOKEN = "hf_card_secret_0123456789"
# what llama.cpp's own programs do needs llama.cpp's binaries (and, for the real model, a GPU box):
# the card's lines that run them are checked for the files they name, not run
NEEDS_LLAMA = ("llama-cli", "llama-server", "llama-mtmd-cli")
# the kit that first converted Kimi-K3 documents this check of a conversion, as it is
KIT_CHECK = """\
import hashlib, json, glob
from gguf import GGUFReader
man = json.load(open("MANIFEST.json"))["tensors"]
for f in sorted(glob.glob("*.gguf")):
    for t in GGUFReader(f).tensors:
        assert hashlib.sha256(t.data.tobytes()).hexdigest() == man[t.name]["sha256"], t.name
print("kit check OK")
"""


def _env(hub: HubServer, tmp: Path) -> dict[str, str]:
    env = hub.client_env(tmp, TOKEN)
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `hf`, `k3lab` as installed
    return env


def _blocks(card: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", card, re.S)


def _check_card_as_a_user(
    hub: HubServer, repo: str, env: dict[str, str], tmp: Path, maker: list[Path]
) -> None:
    from huggingface_hub import ModelCard

    files = hub.files_of(repo)
    text = files["README.md"].decode()
    card = ModelCard(text)
    data = card.data.to_dict()
    assert data["base_model"] == SOURCE and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "gguf" and data["license"] in ("unknown", "other") or data["license"]
    if data["license"] == "other":
        assert data.get("license_name") and data.get("license_link")
    has_mmproj = any(n.startswith("mmproj-") for n in files)
    assert data["pipeline_tag"] == ("image-text-to-text" if has_mmproj else "text-generation")
    from huggingface_hub import constants

    real, constants.ENDPOINT = constants.ENDPOINT, hub.url
    try:
        card.validate()  # (the loopback Hub's /api/validate-yaml, as huggingface_hub asks the real one)
    finally:
        constants.ENDPOINT = real
    # the chat template the set's file 1 carries, said as what it is (k3lab's: the card says so and how to chat)
    from k3lab.kimi_k3 import chat

    assert chat.card_paragraph(chat.template()) in text and "llama-server --jinja" in text
    # every file the card names is in the repo
    for name in set(re.findall(r"`([\w.-]+\.(?:gguf|json|md))`", text)) - {"TEMPLATE.jinja"}:
        assert name in files, name
    # full SHA-256s, each the file's
    for name, sha in re.findall(r"\| `([\w.-]+\.gguf)` \| [\d.,]+ \| \d+ \| `([0-9a-f]{64})` \|", text):
        assert hashlib.sha256(files[name]).hexdigest() == sha, name
    # the card's commands, verbatim, from a fresh folder: downloads, verify; the gguf-py snippet
    user = tmp / f"user-{repo.replace('/', '-')}"
    user.mkdir()
    ran = []
    for block in _blocks(text, "bash"):
        for line in block.strip().splitlines():
            if line.startswith(NEEDS_LLAMA):
                for path in re.findall(r"\S+/([\w.-]+\.gguf)", line):
                    assert path in files, (line, path)
                continue
            if line.startswith("k3lab convert"):  # the maker's command: placeholders, not paths
                assert "META" in line and "OUT" in line
                continue
            r = subprocess.run(
                line, shell=True, cwd=user, env=env, capture_output=True, text=True, timeout=300
            )
            assert r.returncode == 0, (line, r.stdout[-1000:], r.stderr[-2000:])
            ran.append(line)
    assert any(line.startswith("hf download") for line in ran) and any("k3lab verify" in line for line in ran)
    (snippet,) = _blocks(text, "python")
    r = subprocess.run([sys.executable, "-c", snippet], cwd=user, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
    # the kit's check on the download
    local = next(p for p in user.iterdir() if p.is_dir() and (p / "MANIFEST.json").exists())
    r = subprocess.run([sys.executable, "-c", KIT_CHECK], cwd=local, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "kit check OK" in r.stdout, r.stderr
    # nothing of the maker's machine in anything published
    for name, blob in files.items():
        for path in maker:
            assert str(path).encode() not in bytes(blob[:]), (name, path)
        assert TOKEN.encode() not in bytes(blob[:]), name


def test_a_card_of_convert_push_to_works_verbatim(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src, token=TOKEN) as hub:
        env = _env(hub, tmp_path)
        r = run_cli(
            env,
            "convert",
            "--repo",
            SOURCE,
            "--meta",
            str(tmp_path / "meta"),
            "--out-dir",
            str(tmp_path / "out"),
            "--push-to",
            "k3lab-test/Card",
            "--quiet",
        )
        assert r.returncode == 0, r.stderr
        assert {"Kimi-K3-tokenizer.gguf", "mmproj-Kimi-K3-BF16.gguf"} <= set(hub.files_of("k3lab-test/Card"))
        _check_card_as_a_user(hub, "k3lab-test/Card", env, tmp_path, [tmp_path, Path.home()])


def test_a_card_of_publish_works_verbatim(tiny_src: Path, tiny_out: Path, tmp_path: Path) -> None:
    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    with HubServer(tiny_src, token=TOKEN) as hub:
        env = _env(hub, tmp_path)
        assert (
            run_cli(
                env, "tokenizer", "--meta", str(tiny_src), "--out", str(out / "Kimi-K3-tokenizer.gguf")
            ).returncode
            == 0
        )
        assert (
            run_cli(
                env, "vision", "--meta", str(tiny_src), "--out", str(out / "mmproj-Kimi-K3-BF16.gguf")
            ).returncode
            == 0
        )
        r = run_cli(env, "publish", str(out), "k3lab-test/Published")
        assert r.returncode == 0, r.stderr
        card = hub.files_of("k3lab-test/Published")["README.md"].decode()
        assert "a local copy" in card and "--src SOURCE" in card  # the conversion that made the set
        _check_card_as_a_user(
            hub, "k3lab-test/Published", env, tmp_path, [tmp_path, tiny_src.parent, Path.home()]
        )


def test_the_kits_check_runs_verbatim_on_a_k3lab_set(tiny_out: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", KIT_CHECK], cwd=tiny_out, capture_output=True, text=True)
    assert r.returncode == 0 and "kit check OK" in r.stdout, r.stderr


def test_verify_takes_a_manifest_in_the_kits_format(tiny_out: Path, tmp_path: Path, capsys) -> None:
    from k3lab.cli import main

    out = tmp_path / "set"
    shutil.copytree(tiny_out, out)
    kit = tmp_path / "kit.json"
    kit.write_text(json.dumps({"tensors": json.loads((out / "MANIFEST.json").read_text())["tensors"]}))
    assert main(["verify", str(out), "--manifest", str(kit)]) == 0
    assert "verify OK: 9 files, 218 tensors" in capsys.readouterr().out
    man = json.loads((out / "MANIFEST.json").read_text())
    rec = man["files"][4]
    t = rec["tensors"][1]
    data = bytearray((out / rec["file"]).read_bytes())
    data[t["offset"]] ^= 0x40
    (out / rec["file"]).write_bytes(bytes(data))
    assert main(["verify", str(out), "--manifest", str(kit)]) == 1
    assert f"{rec['file']}: tensor {t['name']}: SHA-256 differs from the manifest" in capsys.readouterr().out


def test_private_and_branch_are_what_the_hub_enforces(tiny_src: Path, tmp_path: Path) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    with HubServer(tiny_src, token=TOKEN) as hub:
        env = _env(hub, tmp_path)
        args = [
            "--repo",
            SOURCE,
            "--meta",
            str(tmp_path / "meta"),
            "--out-dir",
            str(tmp_path / "out"),
            "--quiet",
        ]
        r = run_cli(
            env,
            "convert",
            *args,
            "--push-to",
            "k3lab-test/Private",
            "--private",
            "--push-branch",
            "dev",
            "--text-only",
        )
        assert r.returncode == 0, r.stderr
        assert "k3lab-test/Private" in hub.private
        on_dev = {n for n in hub.files_of("k3lab-test/Private", "dev") if n.endswith(".gguf")}
        assert len(on_dev) == 1 and not [n for n in hub.files_of("k3lab-test/Private") if n.endswith(".gguf")]
        with pytest.raises(RepositoryNotFoundError):
            HfApi(endpoint=hub.url, token=False).model_info("k3lab-test/Private", revision="dev")
        assert HfApi(endpoint=hub.url, token=TOKEN).model_info("k3lab-test/Private", revision="dev").private
