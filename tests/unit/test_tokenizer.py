"""The GGUF vocabulary: llama.cpp tokenizes exactly like tiktoken; merges equal the definition."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import gguf
import pytest
import tiktoken
from llama_support import detokenize, needs_llama

from k3lab.cli import main
from k3lab.formats.bpe_merges import bpe_merges, merges_reference
from k3lab.kimi_k3 import chat
from k3lab.kimi_k3.model import MODEL
from k3lab.kimi_k3.synth.generate import extend_vocab
from k3lab.kimi_k3.tokenizer import (
    KIMI_PAT_STR,
    TokenizerError,
    build_vocabulary,
    read_tiktoken,
    token_to_unicode,
)
from k3lab.pipeline.writing.single import convert_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def repack(packed, scale):\n    return np.concatenate([scale, packed], axis=-1)\n",
    "for (int i = 0; i < n; ++i) { sum += x[i] * y[i]; }",
    "Numbers: 1 12 123 1234 12345 3.14159 1,000,000 2026-11-29",
    "   leading spaces, trailing spaces   \n\n\n\tand\ttabs\r\n  \n",
    "人工智能正在改变世界。我们的模型可以理解中文、英文和代码。",
    "中文和English混合的句子，例如：我喜欢用Python写代码。",
    "日本語のテキスト、한국어 문장, Русский текст, Ελληνικά, العربية",
    "Emoji 🙂😀🚀✨🎉👍 and symbols © ® ™ € £ ¥ ≤ ≥ ≠ ∞",
    "Contractions: it's, we've, they're, I'm, you'll, he'd, DON'T, WE'LL",
    "café naïve résumé São Paulo Zürich Ångström jalapeño",
    "https://example.com/models/kimi-k3?revision=main&file=config.json",
    "",
    " ",
    "\n",
]


def _encoding(src: Path) -> tiktoken.Encoding:
    ranks = {
        base64.b64decode(t): int(r)
        for t, r in (line.split() for line in (src / "tiktoken.model").read_text().splitlines())
    }
    return tiktoken.Encoding("kimi-synth", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})


@pytest.fixture(scope="module")
def tokenizer_gguf(tiny_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "Kimi-K3-tokenizer.gguf"
    assert main(["tokenizer", "--meta", str(tiny_src), "--out", str(out)]) == 0
    return out


@needs_llama
def test_llama_cpp_tokenizes_like_tiktoken(tiny_src: Path, tokenizer_gguf: Path) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(str(tokenizer_gguf), vocab_only=True, verbose=False)
    enc = _encoding(tiny_src)
    for text in CORPUS:
        expected = enc.encode(text)
        got = llm.tokenize(text.encode(), add_bos=False, special=False)
        assert got == expected, text
        assert detokenize(llm, got).decode() == text
    assert llm.token_eos() == 1792 - 256 + 2  # <|end_of_msg|>, from config.json
    assert llm.token_bos() == 1792 - 256


def test_gguf_vocabulary_contents(tiny_src: Path, tokenizer_gguf: Path) -> None:
    r = gguf.GGUFReader(tokenizer_gguf)
    assert len(r.tensors) == 0
    f = r.fields
    assert f["tokenizer.ggml.model"].contents() == "gpt2"
    assert f["tokenizer.ggml.pre"].contents() == "kimi-k2"
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == 1792
    assert tokens[1536] == "[BOS]" and tokens[1538] == "<|end_of_msg|>" and tokens[1791] == "[PAD]"
    assert set(types[1536:]) == {3} and set(types[:1536]) == {1}
    assert tokens[32] == "Ġ" and tokens[10] == "Ċ"  # byte-level unicode for space and newline
    assert f["tokenizer.ggml.eos_token_id"].contents() == 1538
    assert f["tokenizer.ggml.unknown_token_id"].contents() == 1790
    assert f["kimi-k3.block_count"].contents() == 8
    assert f["kimi-k3.attention.head_count_kv"].contents() == [0, 0, 0, 1, 0, 0, 0, 1]
    merges = f["tokenizer.ggml.merges"].contents()
    ranked = read_tiktoken(tiny_src / "tiktoken.model")
    assert merges == [f"{token_to_unicode(a)} {token_to_unicode(b)}" for a, b in merges_reference(ranked)]


def test_fast_merges_equal_the_definition_on_a_large_vocabulary(tiny_src: Path) -> None:
    ranked = read_tiktoken(tiny_src / "tiktoken.model")
    big = extend_vocab(ranked, 40_000, seed=3)
    # and a vocabulary with ties (equal-rank pairs at several places) and unreachable tokens
    odd = [bytes([b]) for b in range(256)] + [b"aa", b"aaaa", b"aaa", b"ab", b"aab", b"abab", b"ba", b"aba"]
    for vocab in (ranked, big, odd):
        assert bpe_merges(vocab) == merges_reference(vocab)


def test_the_merges_a_child_derives_are_the_definitions_and_a_plan_never_loads_numba(
    tiny_src: Path, tmp_path: Path
) -> None:
    """A process without numba has the merges derived by a child (LLVM never joins its memory): the
    child's pairs are the definition's, on the large and the odd vocabularies; a child that cannot
    run (no interpreter) leaves the work to this process, with the same pairs; and `k3lab plan` of the
    tiny model, run as a user runs it, ends without numba imported."""
    import subprocess
    import sys

    from k3lab.formats import bpe_merges as bm

    ranked = read_tiktoken(tiny_src / "tiktoken.model")
    big = extend_vocab(ranked, 40_000, seed=3)
    odd = [bytes([b]) for b in range(256)] + [b"aa", b"aaaa", b"aaa", b"ab", b"aab", b"abab", b"ba", b"aba"]
    rank_pairs = lambda v: [(v.index(a), v.index(b)) for a, b in merges_reference(v)]  # noqa: E731
    for vocab in (big, odd):
        got = bm._in_child(vocab)
        assert got is not None and [(vocab[a], vocab[b]) for a, b in got] == merges_reference(vocab)
    assert bm._in_child(odd) == rank_pairs(odd)
    real = sys.executable
    try:
        sys.executable = str(tmp_path / "no-python")
        assert bm._in_child(odd) is None
    finally:
        sys.executable = real
    code = (
        "import sys\nfrom k3lab.cli import main\n"
        f"assert main(['plan', '--meta', {str(tiny_src)!r}, '--out-dir', {str(tmp_path / 'out')!r}]) == 0\n"
        "print('numba' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_chat_template_is_carried(tiny_src: Path, tmp_path: Path) -> None:
    meta = tmp_path / "meta"
    shutil.copytree(tiny_src, meta, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((meta / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}<|end_of_msg|>{% endfor %}"
    (meta / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert build_vocabulary(meta).chat_template == cfg["chat_template"]
    out = convert_tokenizer(MODEL, meta, tmp_path / "t.gguf")
    assert gguf.GGUFReader(out).fields["tokenizer.chat_template"].contents() == cfg["chat_template"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda lines: lines.__setitem__(300, "!!!notbase64 300"), r"tiktoken.model:301: bad base64"),
        (
            lambda lines: lines.__setitem__(300, lines[300].split()[0] + " 299"),
            r"tiktoken.model:301: duplicate rank 299",
        ),
        (lambda lines: lines.pop(400), r"tiktoken.model:401: gap in ranks: rank 400 is missing"),
        (lambda lines: lines.__setitem__(5, "QUJD"), r"tiktoken.model:6: expected 'base64-token rank'"),
        (
            lambda lines: lines.__setitem__(301, lines[300].split()[0] + " 301"),
            r"tiktoken.model:302: token .* already",
        ),
    ],
)
def test_malformed_tiktoken_is_one_line_error_with_line_number(
    tiny_src: Path, tmp_path: Path, edit, message, capsys: pytest.CaptureFixture[str]
) -> None:
    meta = tmp_path / "meta"
    shutil.copytree(tiny_src, meta, ignore=shutil.ignore_patterns("*.safetensors"))
    lines = (meta / "tiktoken.model").read_text().splitlines()
    edit(lines)
    (meta / "tiktoken.model").write_text("\n".join(lines) + "\n")
    with pytest.raises(TokenizerError, match=message):
        read_tiktoken(meta / "tiktoken.model")
    out = tmp_path / "tok.gguf"
    assert main(["tokenizer", "--meta", str(meta), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tiktoken.model:" in err
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_the_chat_template_choice_is_printed_and_embedded(
    tiny_src: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from k3lab.cli import main

    assert main(["tokenizer", "--meta", str(tiny_src), "--out", str(tmp_path / "a" / "t.gguf")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("chat template: k3lab's Kimi-K3 template (SHA-256 ") and "ships none" in first
    embedded = gguf.GGUFReader(tmp_path / "a" / "t.gguf").fields["tokenizer.chat_template"].contents()
    assert embedded == chat.template() and "<|open|>message" in embedded
    template = tmp_path / "k3.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    out = tmp_path / "b" / "t.gguf"
    assert (
        main(["tokenizer", "--meta", str(tiny_src), "--out", str(out), "--chat-template", str(template)]) == 0
    )
    assert capsys.readouterr().out.splitlines()[0] == f"chat template: {template} (--chat-template)"
    assert gguf.GGUFReader(out).fields["tokenizer.chat_template"].contents() == template.read_text()
    assert main(["verify", str(tmp_path / "b"), "--quiet"]) == 0  # its manifest record is beside it


def test_file_1_carries_upstreams_general_keys(tiny_out: Path) -> None:
    """As upstream's converter writes them for this checkpoint (tests/e2e/test_upstream_judge.py runs it)."""
    r = gguf.GGUFReader(next(tiny_out.glob("*-00001-of-*.gguf")))
    assert r.fields["general.type"].contents() == "model"
    assert r.fields["general.size_label"].contents() == "8x1.9M"
    assert "kimi-k3.expert_group_used_count" not in r.fields  # the config has no topk_group


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{% for m in messages %}{{ m.content }}", r"k3\.jinja: not a Jinja template \(line 1: "),
        (
            "{% if false %}x{% endif %}   ",
            r"k3\.jinja: the chat template renders nothing for a one-message chat",
        ),
        (
            "{{ raise_exception('no chat here') }}",
            r"k3\.jinja: the chat template fails on a one-message chat \(.*no chat here",
        ),
        (
            "{{ 'x' * 3000000000 }}",
            r"k3\.jinja: the chat template fails on a one-message chat \(it takes more than 1 GiB\)",
        ),
        (
            "{{ messages }}" + " " * (4 * 1024 * 1024),
            r"k3\.jinja: \d+ bytes; a chat template is at most 4194304 bytes",
        ),
    ],
)
def test_a_chat_template_that_cannot_be_embedded_is_one_line(
    tiny_src: Path, tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from k3lab.cli import main

    template = tmp_path / "k3.jinja"
    template.write_text(text)
    out = tmp_path / "out"
    assert (
        main(["convert", "--meta", str(tiny_src), "--out-dir", str(out), "--chat-template", str(template)])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["fifo", "link out", "link in"])
def test_a_sources_chat_template_jinja_is_read_only_inside_the_checkpoint(
    tiny_src: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from k3lab.cli import main

    meta = tmp_path / "meta"
    shutil.copytree(tiny_src, meta, ignore=shutil.ignore_patterns("*.safetensors"))
    own = meta / "chat_template.jinja"
    elsewhere = tmp_path / "elsewhere.jinja"
    elsewhere.write_text("{{ messages[0].content }}")
    if kind == "fifo":
        os.mkfifo(own)
    elif kind == "link out":
        own.symlink_to(elsewhere)
    else:
        (meta / "templates").mkdir()
        (meta / "templates" / "t.jinja").write_text("{{ messages[0].content }}")
        own.symlink_to(meta / "templates" / "t.jinja")
    out = tmp_path / "t.gguf"
    code = main(["tokenizer", "--meta", str(meta), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    if kind == "link in":
        assert (
            code == 0
            and gguf.GGUFReader(out).fields["tokenizer.chat_template"].contents()
            == "{{ messages[0].content }}"
        )
        return
    assert code == 2 and len(err.splitlines()) == 1 and str(own) in err, err
    assert ("is a FIFO" if kind == "fifo" else "is a link out of") in err
    assert not out.exists()


@pytest.mark.parametrize("entry", ["another-split", "a-pair-dropped", "empty", "truncated"])
def test_a_merges_cache_entry_is_never_read(tiny_src: Path, tmp_path: Path, monkeypatch, entry: str) -> None:
    """An earlier k3lab kept a vocabulary's merges in its cache (``bpe-merges/<file's SHA-256>.merges``,
    its own hash inside). Entries an editor leaves there (another valid-looking split of one token with
    its hash made anew, a pair dropped, no pairs, cut short) change nothing: the merges are the
    derivation's, every time, and no entry is fatal."""
    import hashlib

    import numpy as np

    from k3lab.formats.bpe_merges import bpe_merge_ranks
    from k3lab.kimi_k3.tokenizer import read_tiktoken

    meta = tmp_path / "meta"
    meta.mkdir()
    for name in ("config.json", "tiktoken.model", "tokenizer_config.json"):
        (meta / name).write_bytes((tiny_src / name).read_bytes())
    ranked = read_tiktoken(meta / "tiktoken.model")
    want = merges_reference(ranked)
    pairs = bpe_merge_ranks(ranked)
    rank = {t: r for r, t in enumerate(ranked)}
    # another split of one token into two ranked tokens (still a merge into a later rank)
    other = next(
        (i, (rank[t[:k]], rank[t[k:]]))
        for i, (a, b) in enumerate(pairs)
        for t in [ranked[a] + ranked[b]]
        for k in range(1, len(t))
        if k != len(ranked[a]) and t[:k] in rank and t[k:] in rank
    )
    edited = list(pairs)
    edited[other[0]] = other[1]
    bodies = {
        "another-split": np.asarray(edited, dtype="<i4").tobytes(),
        "a-pair-dropped": np.asarray(pairs[1:], dtype="<i4").tobytes(),
        "empty": b"",
        "truncated": np.asarray(pairs, dtype="<i4").tobytes()[:-3],
    }
    body = bodies[entry]
    cache = tmp_path / "cache"
    (cache / "bpe-merges").mkdir(parents=True)
    key = hashlib.sha256((meta / "tiktoken.model").read_bytes()).hexdigest()
    (cache / "bpe-merges" / f"{key}.merges").write_bytes(
        b"k3lab-bpe-merges/1 " + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    )
    monkeypatch.setenv("K3LAB_CACHE", str(cache))
    merges = build_vocabulary(meta).merges
    assert merges == [f"{token_to_unicode(a)} {token_to_unicode(b)}" for a, b in want]


def test_python_310s_strict_base64_takes_and_refuses_what_311s_does() -> None:
    """The vocabulary's base64 is read strictly on every Python the README names: 3.10 has no
    ``strict_mode``, so its reader must take and refuse exactly what 3.11's takes and refuses."""
    import binascii
    import random

    from k3lab.kimi_k3.tokenizer import b64_strict_310

    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n -_\x00\xff"
    rng = random.Random(0)

    def read(f, t: bytes) -> bytes | None:
        try:
            return f(t)
        except binascii.Error:
            return None

    for _ in range(200_000):
        t = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        if rng.random() < 0.6:
            t = binascii.b2a_base64(
                bytes(rng.randrange(256) for _ in range(rng.randint(0, 9))), newline=False
            )
            if t and rng.random() < 0.4:
                j = rng.randrange(len(t))
                t = t[:j] + bytes([rng.choice(alphabet)]) + t[j + 1 :]
            t += b"=" * (rng.random() < 0.2) * rng.randint(1, 3)
        assert read(lambda x: binascii.a2b_base64(x, strict_mode=True), t) == read(b64_strict_310, t), t
