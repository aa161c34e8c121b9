"""A small byte-level BPE trainer with Kimi's pre-tokenizer, for the synthetic tiktoken.model.

Training is deterministic (ties broken by the pair's bytes), so the shipped vocabulary
``data/tiny.tiktoken`` is reproducible: ``python -m k3lab.kimi_k3.synth.bpe`` rewrites it. Ranks 0..255
are the single bytes in byte order; every later rank is the merge of two earlier tokens.
"""

from __future__ import annotations

import base64
import collections
from importlib import resources
from pathlib import Path

import regex

from k3lab.kimi_k3.tokenizer import KIMI_PAT_STR

# Kimi's split pattern (its tokenizer's pat_str): Han runs; words (two case shapes, Han excluded
# by class intersection) with an optional contraction; 1-3 digits; punctuation runs; newlines;
# trailing spaces; other spaces.
_SPLIT = regex.compile(KIMI_PAT_STR, flags=regex.V1)


def pretokenize(text: str) -> list[str]:
    return _SPLIT.findall(text)


def train(text: str, n_ranks: int) -> list[bytes]:
    """Byte-level BPE on `text` until there are `n_ranks` tokens (or no pair repeats)."""
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    word_counts = collections.Counter(w.encode("utf-8") for w in pretokenize(text))
    words = [list(w) for w in word_counts]  # token ids per distinct word
    counts = list(word_counts.values())
    pairs: collections.Counter[tuple[int, int]] = collections.Counter()
    where: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    for wi, toks in enumerate(words):
        for p in zip(toks, toks[1:]):
            pairs[p] += counts[wi]
            where[p].add(wi)
    while len(vocab) < n_ranks:
        best = (
            max((c, vocab[a] + b"\0" + vocab[b], (a, b)) for (a, b), c in pairs.items() if c > 0)
            if pairs
            else None
        )
        if best is None:
            break
        a, b = best[2]
        new = len(vocab)
        vocab.append(vocab[a] + vocab[b])
        for wi in sorted(where.pop((a, b), ())):
            toks = words[wi]
            for p in zip(toks, toks[1:]):
                pairs[p] -= counts[wi]
            merged, i = [], 0
            while i < len(toks):
                if i + 1 < len(toks) and toks[i] == a and toks[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(toks[i])
                    i += 1
            words[wi] = merged
            for p in zip(merged, merged[1:]):
                pairs[p] += counts[wi]
                where[p].add(wi)
        pairs = collections.Counter({p: c for p, c in pairs.items() if c > 0})
    return vocab


def corpus() -> str:
    return resources.files("k3lab.kimi_k3.synth").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def format_tiktoken(vocab: list[bytes]) -> str:
    return "".join(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(vocab))


def shipped_tiktoken() -> str:
    return resources.files("k3lab.kimi_k3.synth").joinpath("data/tiny.tiktoken").read_text(encoding="ascii")


TINY_RANKS = 1536  # the tiny presets' 1792-token vocabulary minus 256 specials


def main() -> None:
    vocab = train(corpus(), TINY_RANKS)
    if len(vocab) != TINY_RANKS:
        raise SystemExit(f"corpus too small: only {len(vocab)} ranks")
    out = Path(__file__).parent / "data" / "tiny.tiktoken"
    out.write_text(format_tiktoken(vocab), encoding="ascii")
    print(f"wrote {out} ({len(vocab)} ranks)")


if __name__ == "__main__":
    main()
