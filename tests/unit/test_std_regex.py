"""``--tensor-type`` patterns mean what ``std::regex`` means (llama-quantize compiles them with it), judged
by std::regex itself (``tests/std_regex_judge.cpp``, built with this machine's C++ library): every
pattern k3lab takes finds exactly the names std::regex finds; every pattern std::regex refuses, k3lab
refuses; the constructs the two read differently are refused in one line naming them; a pattern that
backtracks without end is one line, in bounded time."""

from __future__ import annotations

import random
import subprocess
import time

import pytest
from llama_tree import std_regex_judge

from k3lab.pipeline.quantizing.std_regex import SEARCH_SECONDS, PatternError, StdRegex, lowercase

NAMES = [
    "token_embd.weight", "output.weight", "output_norm.weight", "blk.0.ffn_gate.weight",
    "blk.3.attn_kv_a_mqa.weight", "blk.3.attn_k_b.weight", "blk.10.ffn_down_exps.weight",
    "blk.10.ffn_up_shexp.weight", "blk.92.ssm_conv1d_q.weight", "blk.7.exp_probs_b.bias",
    "a", "ab", "b}", "x]y", "a{2}", "A.B", "blk.3.", "\x01ctl", "ZzZ", "caf\u00e9.weight", "a-b", "a\\b",
]  # fmt: skip
TOKENS = [
    "a", "b", "e", "s", "x", "_", "0", "9", "exps", "blk", "weight", ".", "\\.", "*", "+", "?", "*?", "|",
    "(", ")", "(?:", "(?=", "(?!", "(?<=", "[", "]", "[^", "[a-z]", "[0-9]", "[^_]", "{2}", "{1,}",
    "{0,3}", "{,2}", "{", "}", "^", "$", "\\d", "\\w", "\\s", "\\D", "\\W", "\\b", "\\B", "-", "\\-",
    "\\\\", "\\a", "\\z", "\\A", "\\N{x}", "[[:alpha:]]", "[[:digit:]]", "\\0", "\\cJ", "\\x41", "\\x", "\\1",
    "\u00e9", "]", "[]", "[^]", "[-a]", "[a-]", "[\\b]", "[.]", "[\\d_]",
]  # fmt: skip
NAMED = {  # the constructs the issue names, and what k3lab says of each
    "[[:alpha:]]_exps": "POSIX class",
    "ffn{,2}": "refuses {,n}",
    "\\N{LATIN SMALL LETTER A}": "'\\N' is the letter 'N'",
    "ffn.*+": "a quantifier after a quantifier",
    "(?<=blk)\\.": "std::regex knows only",
    "(?P<x>ffn)": "std::regex knows only",
    "\\Aoutput": "'\\A' is the letter 'A'",
    "(a)\\1": "backreference",
}


def _judge(patterns: list[str], names: list[str]) -> list[str | None]:
    """std::regex's verdict on each pattern: None (refused), "T" (its searches took over two seconds:
    not judged), or the names it finds, as 0/1."""
    lines = [f"P\t{p}" for p in patterns] + [f"N\t{n}" for n in names]
    out = subprocess.run([str(std_regex_judge())], input="\n".join(lines).encode("utf-8", "surrogateescape"),
                         capture_output=True, timeout=600, check=True).stdout.decode().splitlines()  # fmt: skip
    assert len(out) == len(patterns)
    return [None if line == "E" else line for line in out]


def _ours(pattern: str, names: list[str]) -> str | None:
    try:
        compiled = StdRegex(pattern)
    except PatternError:
        return None
    return "".join("1" if compiled.search(n) else "0" for n in names)


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 7))) for _ in range(n)]


def test_every_pattern_taken_finds_what_std_regex_finds_and_std_regex_refusals_are_refused() -> None:
    patterns = list(NAMED) + _corpus(6000, seed=7) + _corpus(6000, seed=2)
    verdicts = _judge(patterns, NAMES)
    taken = refused_both = refused_ours = 0
    for pattern, theirs in zip(patterns, verdicts):
        if theirs == "T":
            continue
        ours = _ours(pattern, NAMES)
        if theirs is None:
            assert ours is None, f"{pattern!r}: std::regex refuses it, k3lab takes it ({ours})"
            refused_both += 1
        elif ours is None:
            refused_ours += 1
        else:
            assert ours == theirs, f"{pattern!r}: k3lab finds {ours}, std::regex {theirs} (names {NAMES})"
            taken += 1
    # the corpus exercises all three (a generator that produced only refusals would prove nothing)
    assert taken > 1000 and refused_both > 500 and refused_ours > 200, (taken, refused_both, refused_ours)


@pytest.mark.parametrize("pattern", list(NAMED))
def test_a_construct_the_two_read_differently_is_refused_in_one_line_naming_it(pattern: str) -> None:
    with pytest.raises(PatternError) as e:
        StdRegex(pattern)
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"--tensor-type {pattern!r}:") and NAMED[pattern] in said


def test_a_pattern_that_backtracks_without_end_is_one_line_in_bounded_time() -> None:
    compiled = StdRegex("(.|.)*[a-z][0-9]$")
    start = time.monotonic()
    with pytest.raises(PatternError, match="took over .* s"):
        compiled.search("blk.10.ffn_down_exps.weight")
    assert time.monotonic() - start < 10 * SEARCH_SECONDS


def test_a_pattern_is_lowercased_as_llama_quantize_lowercases_it() -> None:
    """``tolower`` on each byte in the C locale: ASCII letters only."""
    assert lowercase("FFN_UP_EXPS=Q4_K") == "ffn_up_exps=q4_k"
    assert lowercase("\u00c9X") == "\u00c9x"  # (a non-ASCII letter keeps its bytes)
