"""One way in: the CLI, the notebooks and the demo make the same run from the same inputs; a second
model family (the toy of tests/toy_model.py) goes through the CLI end to end, with its own card, by
naming its module (no edit anywhere else); a set's card is the same whether it was published by
`convert --push-to` or by `publish`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import toy_model
from conftest import ROOT, run_cli
from hub_server import HubServer

from k3lab.cli import build_parser
from k3lab.request import Request

TESTS = ROOT / "tests"
TARGET = "k3lab-test/Toy-GGUF"


def _cli_request(*argv: str) -> Request:
    return Request.of(build_parser().parse_args(list(argv)))


def test_a_notebook_and_the_cli_make_the_same_run(tiny_src: Path, tmp_path: Path) -> None:
    from k3lab import explore

    out = tmp_path / "out"
    cli = _cli_request("convert", "--meta", str(tiny_src), "--src", str(tiny_src), "--out-dir", str(out))
    notebook = explore.opening._request(tiny_src, tiny_src, out_dir=str(out))
    assert cli.source() == notebook.source() == explore.source_spec(tiny_src, tiny_src)
    assert cli.output_source() == notebook.output_source()
    assert cli.run_options() == notebook.run_options()
    # the Hub: the same spec (repo, revision, the output folder's scratch), whoever asks
    hub = _cli_request("plan", "--meta", str(tmp_path / "m"), "--repo", "org/name", "--revision", "v1")
    assert hub.source() == explore.source_spec(tmp_path / "m", repo="org/name", revision="v1")


def test_a_request_checks_its_values_as_the_cli_does(capsys: pytest.CaptureFixture[str]) -> None:
    from k3lab.errors import K3LabError

    for bad in ({"jobs": 0}, {"retry_budget": float("nan")}, {"repo": "no-org"}, {"push_to": "a/b/c"}):
        with pytest.raises(K3LabError, match="argument --"):
            Request(**bad)


def test_the_toy_architecture_goes_through_the_cli_with_its_own_card(tmp_path: Path) -> None:
    """plan, convert, verify and publish of a model k3lab has never heard of, named by its module: the
    toy's keys in the files, the toy's card in the repo, every command of the card that needs no
    GPU run as written."""
    src = tmp_path / "toy"
    toy_model.write_checkpoint(src, seed=3)
    out = tmp_path / "out"
    with HubServer(src, repo="k3lab-test/Toy") as hub:
        env = hub.client_env(tmp_path) | {"PYTHONPATH": str(TESTS)}
        model = ["--model", "toy_model"]
        model += ["--split-max-tensors", "1"]  # three files from the toy's one
        plan = run_cli(env, "plan", *model, "--meta", str(src), "--json")
        assert plan.returncode == 0, plan.stderr
        assert [f["filename"] for f in json.loads(plan.stdout)["files"]] == [
            f"Toy-MXFP4-0000{k}-of-00003.gguf" for k in (1, 2, 3)
        ]
        conv = run_cli(env, "convert", *model, "--meta", str(src), "--out-dir", str(out), "--quiet")
        assert conv.returncode == 0 and "3 written" in conv.stdout, conv.stderr
        assert (
            gguf.GGUFReader(out / "Toy-MXFP4-00001-of-00003.gguf").fields["general.architecture"].contents()
            == "toy"
        )
        model = model[:2]
        ver = run_cli(env, "verify", *model, str(out), "--src", str(src), "--quiet")
        assert ver.returncode == 0 and "verify OK" in ver.stdout, ver.stdout + ver.stderr
        pub = run_cli(env, "publish", *model, str(out), TARGET)
        assert pub.returncode == 0, pub.stderr
        files = hub.files_of(TARGET)
        card = files["README.md"].decode()
        assert card.startswith("---\nbase_model: k3lab-test/Toy\n") and "# Toy GGUF (MXFP4): a toy" in card
        assert "Kimi" not in card and "toy_model" in card
        assert "# Toy tensor map" in files["TENSOR_MAP.md"].decode()
        # the card's verify commands, verbatim, in a fresh folder
        blocks = [b.split("```", 1)[0] for b in card.split("```bash\n")[1:]]
        user = tmp_path / "user"
        user.mkdir()
        for line in blocks[-1].strip().splitlines():
            r = subprocess.run(
                line, shell=True, cwd=user, env=env | {"PATH": _path()}, capture_output=True, text=True
            )
            assert r.returncode == 0, (line, r.stdout, r.stderr)


def _path() -> str:
    return f"{Path(sys.executable).parent}:{os.environ['PATH']}"


def test_the_card_of_publish_is_the_card_of_convert_push_to(tiny_src: Path, tmp_path: Path) -> None:
    with HubServer(tiny_src) as hub:
        env = hub.client_env(tmp_path)
        base = ["--repo", "moonshotai/Kimi-K3", "--meta", str(tmp_path / "meta"), "--quiet"]
        pushed = run_cli(env, "convert", *base, "--out-dir", str(tmp_path / "a"), "--push-to", "k3lab-test/A")
        assert pushed.returncode == 0, pushed.stderr
        local = run_cli(env, "convert", *base, "--out-dir", str(tmp_path / "b"))
        assert local.returncode == 0, local.stderr
        # the files convert --push-to publishes beside the set, made here by their own commands
        tok = run_cli(
            env,
            "tokenizer",
            "--meta",
            str(tmp_path / "meta"),
            "--out",
            str(tmp_path / "b" / "Kimi-K3-tokenizer.gguf"),
        )
        vis = run_cli(env, "vision", *base[:4], "--out", str(tmp_path / "b" / "mmproj-Kimi-K3-BF16.gguf"))
        assert tok.returncode == 0 and vis.returncode == 0, tok.stderr + vis.stderr
        published = run_cli(env, "publish", str(tmp_path / "b"), "k3lab-test/B")
        assert published.returncode == 0, published.stderr
        a = hub.files_of("k3lab-test/A")["README.md"].decode()
        b = hub.files_of("k3lab-test/B")["README.md"].decode()
    assert a.replace("k3lab-test/A", "REPO") == b.replace("k3lab-test/B", "REPO")
    assert str(tmp_path) not in a  # no path of the maker's
    assert "k3lab convert --repo moonshotai/Kimi-K3 --revision" in a and "--out-dir OUT" in a


def test_the_retry_budget_is_taken_where_the_hub_is_used(tiny_src: Path) -> None:
    """``--retry-budget`` bounds publishing's uploads as it bounds a Hub source's downloads: taken with
    ``--push-to`` from a local source, refused (one line) where no Hub is used at all."""
    from k3lab.errors import K3LabError
    from k3lab.request import Request

    Request(meta=str(tiny_src), push_to="k3lab-demo/x", retry_budget=5.0).source()  # (no error)
    with pytest.raises(K3LabError, match=r"^--retry-budget is for the Hub: it needs --repo or --push-to$"):
        Request(meta=str(tiny_src), retry_budget=5.0).source()
