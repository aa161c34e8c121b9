"""Kimi's tiktoken vocabulary -> the GGUF vocabulary llama.cpp's BPE tokenizer (pre ``kimi-k2``) reads.

From the files alone (``tiktoken.model``, ``tokenizer_config.json``, ``config.json``), without
transformers or the repo's remote code:

- token strings in GPT-2's byte-level unicode form; the 256 specials verbatim; holes ``[PADi]``;
- token types: normal, control (specials), unused (holes);
- merges recovered from the ranks. The definition (upstream's): for each multi-byte token, run
  BPE on its bytes allowing only lower ranks; if that ends in two parts, they are its merge.
  ``bpe_merges.merges_reference`` is that definition written plainly; ``bpe_merges.bpe_merges``
  computes the same list in compiled code;
- special ids: eos is the config's ``<|end_of_msg|>``, not ``[EOS]``;
- the chat template: the checkpoint's own, else k3lab's (``chat.py``: Kimi-K3 ships its format as Python).
"""

from __future__ import annotations

import binascii
import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFValueType, Keys, TokenType

from k3lab.errors import K3LabError
from k3lab.formats.bpe_merges import bpe_merge_ranks
from k3lab.formats.files import InputFileError, read_bounded, read_json, read_text, within
from k3lab.formats.gguf_stream import KV
from k3lab.kimi_k3 import chat
from k3lab.kimi_k3.config import K3Config

Tok = Keys.Tokenizer

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = (
    int(t) for t in (TokenType.NORMAL, TokenType.CONTROL, TokenType.UNUSED)
)
PRE_TOKENIZER = "kimi-k2"
# Kimi's split pattern (tiktoken `pat_str`), as the facts give it; llama.cpp calls it `kimi-k2`
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


TOKENIZER_LIMIT = 64 * 1024 * 1024  # the real tiktoken.model is ~2.5 MB
TEMPLATE_LIMIT = 4 * 1024 * 1024


class TokenizerError(K3LabError):
    """tiktoken.model or tokenizer_config.json is malformed."""


def read_tiktoken(path: str | Path) -> list[bytes]:
    """Read ``tiktoken.model`` (``base64 rank`` per line); returns the tokens in rank order."""
    path = Path(path)
    try:
        data = read_bounded(path, TOKENIZER_LIMIT, "tiktoken.model")
    except InputFileError as e:
        raise TokenizerError(str(e)) from None
    tokens = _read_tiktoken_fast(data)
    if tokens is None:  # something is off: the line-by-line reader names the line
        tokens = _read_tiktoken_checked(path, data.splitlines())
    missing_bytes = set(range(256)) - {t[0] for t in tokens if len(t) == 1}
    if missing_bytes:
        raise TokenizerError(
            f"{path}: byte 0x{min(missing_bytes):02x} has no token; byte-level BPE needs all 256"
        )
    return tokens


# what Python 3.11's strict base64 takes, exactly (held by tests/unit/test_tokenizer.py on generated
# text): the alphabet only; after whole quartets any padding, after a partial one exactly what it lacks
STRICT_B64 = re.compile(
    rb"(?:[A-Za-z0-9+/]{4})+=*|(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)|"
)


def b64_strict(text: bytes) -> bytes:
    """Base64 read strictly: Python 3.11's ``strict_mode``; on 3.10, which has none, the same text
    taken and refused (``STRICT_B64``, then the lenient reader); ``binascii.Error`` either way."""
    if sys.version_info >= (3, 11):
        return binascii.a2b_base64(text, strict_mode=True)
    return b64_strict_310(text)


def b64_strict_310(text: bytes) -> bytes:
    if not STRICT_B64.fullmatch(text):
        raise binascii.Error("not strict base64")
    return binascii.a2b_base64(text)


def _read_tiktoken_fast(data: bytes) -> list[bytes] | None:
    """The well-formed case in bulk: ranks 0..n-1 in order, distinct tokens. None if not that."""
    fields = data.split()
    lines = data.splitlines()
    if len(fields) != 2 * (len(lines) - lines.count(b"")) or any(not ln.strip() for ln in lines if ln):
        return None
    try:
        tokens = list(map(b64_strict, fields[0::2]))
        ranks = list(map(int, fields[1::2]))
    except (binascii.Error, ValueError):
        return None
    if ranks != list(range(len(ranks))) or len(set(tokens)) != len(tokens):
        return None
    return tokens


def _read_tiktoken_checked(path: Path, lines: list[bytes]) -> list[bytes]:
    by_rank: dict[int, bytes] = {}
    first_line: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:60]!r}")
        try:
            token = b64_strict(parts[0])
        except (binascii.Error, ValueError):
            raise TokenizerError(
                f"{path}:{lineno}: bad base64 {parts[0][:40].decode(errors='replace')!r}"
            ) from None
        try:
            rank = int(parts[1])
        except ValueError:
            raise TokenizerError(f"{path}:{lineno}: rank {parts[1][:20]!r} is not an integer") from None
        if rank in by_rank:
            raise TokenizerError(f"{path}:{lineno}: duplicate rank {rank}")
        if token in first_line:
            raise TokenizerError(
                f"{path}:{lineno}: token {token!r} already has a rank (line {first_line[token]})"
            )
        by_rank[rank] = token
        first_line[token] = lineno
    n = len(by_rank)
    if n and (min(by_rank) != 0 or max(by_rank) != n - 1):
        missing = next(r for r in range(max(by_rank) + 1) if r not in by_rank)
        line_after = next((first_line[by_rank[r]] for r in sorted(by_rank) if r > missing), len(lines))
        raise TokenizerError(f"{path}:{line_after}: gap in ranks: rank {missing} is missing")
    return [by_rank[r] for r in range(n)]


def read_chat_template(path: str | Path, inside: str | Path | None = None) -> str:
    """A Jinja chat template file's text; with ``inside``, a file of that folder (the checkpoint's own
    ``chat_template.jinja``: a link out of it is refused)."""
    path = Path(path)
    try:
        real = within(path, inside, "chat template") if inside is not None else path
        text = read_text(real, TEMPLATE_LIMIT, "chat template", follow=inside is None)
    except InputFileError as e:
        raise TokenizerError(str(e)) from None
    if not text.strip():
        raise TokenizerError(f"{path}: the chat template is empty")
    return text


def given_chat_template(path: str | Path) -> str:
    """``--chat-template FILE``: read, and checked to be Jinja that renders a one-message chat."""
    text = read_chat_template(path)
    chat.check(text, path)
    return text


def chat_template_choice(meta_dir: str | Path, flag: str | Path | None = None) -> tuple[str | None, str]:
    """The chat template to embed and one line saying which: ``--chat-template FILE`` wins, else the
    source's own (``tokenizer_config.json``, then ``chat_template.jinja``), else k3lab's (``chat.py``).
    Only the flag's text is returned: the vocabulary takes the others from the files as it is built."""
    meta_dir = Path(meta_dir)
    fetched = (meta_dir / "tokenizer_config.json").is_file()
    if fetched:
        _, tok_cfg = read_specials(meta_dir / "tokenizer_config.json")
        own = checked_source_chat_template(meta_dir, tok_cfg) if flag is None else None
    else:  # (not fetched from the Hub yet)
        tok_cfg, own = {}, None
    if flag is not None:
        text = given_chat_template(flag)
        replacing = ", replacing the source's own" if _ships_template(meta_dir, tok_cfg) else ""
        return text, f"chat template: {flag} (--chat-template{replacing})"
    if own is not None:
        where = "tokenizer_config.json" if tok_cfg.get("chat_template") else "chat_template.jinja"
        return None, f"chat template: the source's own ({meta_dir / where})"
    ours = chat.describe(chat.template())
    if not fetched:
        return None, f"chat template: the checkpoint's own if it ships one, else {ours}"
    return None, f"chat template: {ours} (the checkpoint ships none; --chat-template FILE replaces it)"


def source_chat_template(meta_dir: Path, tok_cfg: dict) -> str | None:
    """The checkpoint's own chat template: ``tokenizer_config.json``'s, else ``chat_template.jinja``,
    held to the bound a template file is held to (one line past it)."""
    if tok_cfg.get("chat_template"):
        text = tok_cfg["chat_template"]
        if len(text.encode("utf-8", "surrogatepass")) > TEMPLATE_LIMIT:
            raise TokenizerError(
                f"{meta_dir / 'tokenizer_config.json'}: chat_template is more than {TEMPLATE_LIMIT} bytes;"
                " a chat template is not this large"
            )
        return text
    path = meta_dir / "chat_template.jinja"
    return read_chat_template(path, inside=meta_dir) if os.path.lexists(path) else None


def _ships_template(meta_dir: Path, tok_cfg: dict) -> bool:
    return bool(tok_cfg.get("chat_template")) or os.path.lexists(meta_dir / "chat_template.jinja")


def checked_source_chat_template(meta_dir: Path, tok_cfg: dict) -> str | None:
    """The checkpoint's own chat template, checked as one given by flag is (it renders a one-message
    chat in a bounded process of its own) before it is embedded."""
    text = source_chat_template(meta_dir, tok_cfg)
    if text is not None:
        where = "tokenizer_config.json" if tok_cfg.get("chat_template") else "chat_template.jinja"
        chat.check(text, meta_dir / where)
    return text


def read_specials(path: str | Path) -> tuple[dict[int, str], dict]:
    """The special tokens of ``tokenizer_config.json`` (``added_tokens_decoder``) and the whole config."""
    path = Path(path)
    try:
        cfg = read_json(path, TOKENIZER_LIMIT, "tokenizer config")
    except InputFileError as e:
        raise TokenizerError(str(e)) from None
    if not isinstance(cfg, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    decoder = cfg.get("added_tokens_decoder")
    decoder = {} if decoder is None else decoder
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{path}: added_tokens_decoder is not an object of id -> token")
    specials: dict[int, str] = {}
    for key, d in decoder.items():
        try:
            i = int(key)
        except ValueError:
            raise TokenizerError(f"{path}: added_tokens_decoder key {key!r} is not an integer id") from None
        if i < 0 or not isinstance(d, dict) or not isinstance(d.get("content"), str):
            raise TokenizerError(
                f"{path}: added_tokens_decoder[{key!r}] needs an id >= 0 and a string 'content'"
            )
        specials[i] = d["content"]
    template = cfg.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{path}: chat_template is not a string")
    return specials, cfg


# --- byte-level unicode (GPT-2): every byte gets a printable character ---------------------------


def _byte_to_unicode() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _byte_to_unicode()
_TRANSLATE = {b: c for b, c in BYTE_TO_UNICODE.items()}


def token_to_unicode(token: bytes) -> str:
    return token.decode("latin-1").translate(_TRANSLATE)


def tokens_to_unicode(tokens: list[bytes]) -> list[str]:
    """token_to_unicode over a whole vocabulary: one translate of the joined bytes, then slices."""
    text = b"".join(tokens).decode("latin-1").translate(_TRANSLATE)
    ends = list(itertools.accumulate(map(len, tokens)))  # one character per byte
    return [text[a:b] for a, b in zip([0, *ends[:-1]], ends)]


# --- the GGUF vocabulary --------------------------------------------------------------------------


@dataclass
class Vocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    chat_template: str | None = None
    specials: dict[int, str] = field(default_factory=dict)

    def kvs(self) -> list[KV]:
        S, U32, ARR = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.ARRAY
        kvs = [
            KV(Tok.MODEL, "gpt2", S),
            KV(Tok.PRE, PRE_TOKENIZER, S),
            KV(Tok.LIST, self.tokens, ARR, S),
            KV(Tok.TOKEN_TYPE, self.types, ARR, GGUFValueType.INT32),
            KV(Tok.MERGES, self.merges, ARR, S),
        ]
        for key, value in (
            (Tok.BOS_ID, self.bos_id),
            (Tok.EOS_ID, self.eos_id),
            (Tok.UNK_ID, self.unk_id),
            (Tok.PAD_ID, self.pad_id),
        ):
            if value is not None:
                kvs.append(KV(key, value, U32))
        kvs += [KV(Tok.ADD_BOS, False, GGUFValueType.BOOL), KV(Tok.ADD_EOS, False, GGUFValueType.BOOL)]
        if self.chat_template:
            kvs.append(KV(Tok.CHAT_TEMPLATE, self.chat_template, S))
        return kvs


def build_vocabulary(
    meta_dir: str | Path, cfg: K3Config | None = None, chat_template: str | None = None
) -> Vocabulary:
    """Read the tokenizer files in ``meta_dir`` and build the GGUF vocabulary; ``chat_template`` (a
    template's text, checked by its giver) replaces the checkpoint's own, which is checked here."""
    meta_dir = Path(meta_dir)
    cfg = cfg or K3Config.load(meta_dir)
    ranked = read_tiktoken(meta_dir / "tiktoken.model")
    specials, tok_cfg = read_specials(meta_dir / "tokenizer_config.json")
    n_vocab = cfg.n_vocab
    path = meta_dir / "tokenizer_config.json"
    clash = [i for i in specials if i < len(ranked)]
    if clash:
        raise TokenizerError(f"{path}: special token id {clash[0]} collides with a tiktoken rank")
    over = [i for i in specials if i >= n_vocab]
    if over or len(ranked) > n_vocab:
        raise TokenizerError(
            f"{path}: token id {over[0] if over else len(ranked) - 1} is beyond "
            f"vocab_size {n_vocab} of {cfg.path}"
        )
    as_unicode = tokens_to_unicode(ranked)
    # a merge's two parts are themselves ranked tokens, so their strings are already made. The
    # merges are derived every time (0.3 s for Kimi-K3's vocabulary, warm): a cache of them saved
    # less than it cost to prove an entry is what the derivation gives (docs/benchmarks.md)
    pairs = bpe_merge_ranks(ranked)
    merges = list(map(" ".join, ((as_unicode[a], as_unicode[b]) for a, b in pairs)))
    tokens = as_unicode + [f"[PAD{i}]" for i in range(len(ranked), n_vocab)]
    types = [TOKEN_NORMAL] * len(ranked) + [TOKEN_UNUSED] * (n_vocab - len(ranked))
    for i, content in specials.items():
        tokens[i], types[i] = content, TOKEN_CONTROL
    by_content = {c: i for i, c in specials.items()}

    def special_id(key: str) -> int | None:
        value = tok_cfg.get(key)
        content = value.get("content") if isinstance(value, dict) else value
        return by_content.get(content) if content is not None else None

    def pick(config_key: str, tok_key: str) -> int | None:
        return cfg.token_id(config_key) if cfg.token_id(config_key) is not None else special_id(tok_key)

    return Vocabulary(
        tokens=tokens,
        types=types,
        merges=merges,
        bos_id=pick("bos_token_id", "bos_token"),
        eos_id=pick("eos_token_id", "eos_token"),  # K3: <|end_of_msg|>, the end of a turn
        pad_id=pick("pad_token_id", "pad_token"),
        unk_id=special_id("unk_token"),
        # the one given, else the checkpoint's own, else k3lab's: Kimi-K3 ships its chat format only
        # as Python
        chat_template=chat_template or checked_source_chat_template(meta_dir, tok_cfg) or chat.template(),
        specials=specials,
    )
