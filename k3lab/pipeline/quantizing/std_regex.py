"""``--tensor-type`` patterns in the language ``llama-quantize`` reads them in: C++'s ``std::regex``
(ECMAScript grammar, libstdc++, over the name's bytes), searched in each tensor's name. Python's ``re``
reads many patterns otherwise, so a pattern is parsed here as libstdc++ parses it and written out as
a Python pattern (over bytes) that matches exactly the same names; what the two languages cannot be
made to agree on is refused in one line naming the construct.

What is translated (libstdc++'s meaning on the left, Python's spelling on the right):
  ``.``  any byte but ``\\n`` and ``\\r``    ``[^\\n\\r]``
  ``$``  the end of the name                  ``\\Z`` (Python's ``$`` also matches before a final ``\\n``)
  ``\\0``  NUL (a digit after it is a digit)  ``\\x00``
  ``\\cX``  a control character               ``\\xHH``
  a ``[`` inside a class                     ``\\[``
  ``}`` and ``]`` outside a class            themselves
What is refused (with why): a POSIX class ``[[:alpha:]]``, ``[[.x.]]``, ``[[=x=]]`` (Python has none);
``{,n}`` and a ``{`` that begins no repeat count (std::regex refuses them, Python reads a count or a
letter); a quantifier after a quantifier (``.*+``: std::regex repeats the repeat, Python makes it
possessive); a backreference (the two disagree when its group took no part); a letter escaped that
std::regex reads as the letter itself (``\\a``, ``\\z``, ``\\A``, ``\\N``...: to Python a control
character, an anchor or an error); groups other than ``(...)``, ``(?:...)``, ``(?=...)``, ``(?!...)``;
an empty class ``[]`` or ``[^]``; ``\\u`` above 0x7f (the name's bytes are not characters to
std::regex). Both sides then read the same ASCII classes: ``\\d``, ``\\w``, ``\\s``, ``\\b`` over bytes.

A search is bounded in time (``SEARCH_SECONDS``): a pattern that backtracks without end is one line
rather than a run that never ends (``llama-quantize`` would hang on it). Matching runs once, in the
plan: the tensors' names are known there.
"""

from __future__ import annotations

import regex

from k3lab.errors import K3LabError

SEARCH_SECONDS = 2.0  # one name searched, at most (a sane pattern takes microseconds)
MAX_PATTERN = 512
_SHARED_ESCAPES = set("bBdDsSwWfnrtv")  # the same meaning to both (over bytes)
_CONTROL = {"f": "\\f", "n": "\\n", "r": "\\r", "t": "\\t", "v": "\\v"}
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class PatternError(K3LabError):
    """A pattern llama-quantize would refuse, or read otherwise than Python: one line."""


def lowercase(pattern: str) -> str:
    """What llama-quantize does to a pattern first (``tolower`` on each byte, the C locale: ASCII)."""
    return pattern.translate(_ASCII_LOWER)


class StdRegex:
    """A pattern as ``std::regex`` reads it (``pattern``: as given), searched in names."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.python = _Translator(pattern).translate()
        try:
            self._compiled = regex.compile(self.python.encode("utf-8", "surrogateescape"), regex.VERSION0)
        except (regex.error, ValueError) as e:  # (whatever passed the parser but not Python: refused)
            raise PatternError(
                f"--tensor-type {pattern!r}: not a pattern k3lab can read as std::regex does ({e})"
            ) from None

    def search(self, name: str) -> bool:
        try:
            return (
                self._compiled.search(name.encode("utf-8", "surrogateescape"), timeout=SEARCH_SECONDS)
                is not None
            )
        except TimeoutError:
            raise PatternError(
                f"--tensor-type {self.pattern!r}: searching tensor {name} took over {SEARCH_SECONDS:g} s "
                "(a pattern that backtracks without end: write it without a repeat inside a repeat)"
            ) from None


def _refuse(pattern: str, why: str) -> PatternError:
    return PatternError(f"--tensor-type {pattern!r}: {why}")


class _Translator:
    """A recursive-descent reading of libstdc++'s ECMAScript grammar, writing Python as it goes."""

    def __init__(self, pattern: str):
        if not pattern or len(pattern) > MAX_PATTERN:
            raise _refuse(pattern, f"a pattern of 1 to {MAX_PATTERN} characters")
        self.p, self.i, self.out, self.groups = pattern, 0, [], 0

    def refuse(self, why: str) -> PatternError:
        return _refuse(self.p, why)

    def peek(self, k: int = 0) -> str:
        return self.p[self.i + k] if self.i + k < len(self.p) else ""

    def translate(self) -> str:
        self.disjunction()
        if self.i != len(self.p):  # (an unmatched ")")
            raise self.refuse(f"an unmatched ')' at {self.i} (std::regex refuses it)")
        return "".join(self.out)

    def disjunction(self) -> None:
        self.alternative()
        while self.peek() == "|":
            self.i += 1
            self.out.append("|")
            self.alternative()

    def alternative(self) -> None:
        while self.peek() not in ("", "|", ")"):
            self.term()

    def term(self) -> None:
        c = self.peek()
        if c == "^":
            self.i += 1
            self.out.append("^")
            return self.no_quantifier("^")
        if c == "$":
            self.i += 1
            self.out.append("\\Z")
            return self.no_quantifier("$")
        if c == "\\" and self.peek(1) in ("b", "B"):
            self.out.append(self.p[self.i : self.i + 2])
            self.i += 2
            return self.no_quantifier(self.p[self.i - 2 : self.i])
        if c == "(" and self.peek(1) == "?" and self.peek(2) in ("=", "!"):
            self.out.append(self.p[self.i : self.i + 3])
            self.i += 3
            self.group_body()
            return self.no_quantifier("a lookahead")
        self.atom()
        self.quantifier()

    def no_quantifier(self, what: str) -> None:
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.peek(1).isdigit()):
            raise self.refuse(f"a quantifier after {what!r} (std::regex refuses it)")

    def group_body(self) -> None:
        self.disjunction()
        if self.peek() != ")":
            raise self.refuse("a '(' never closed (std::regex refuses it)")
        self.i += 1
        self.out.append(")")

    def atom(self) -> None:
        c = self.peek()
        if c == "(":
            if self.peek(1) == "?":
                if self.peek(2) != ":":
                    raise self.refuse(
                        f"the group '{self.p[self.i : self.i + 4]}...': std::regex knows only (...), (?:...), "
                        "(?=...) and (?!...)"
                    )
                self.out.append("(?:")
                self.i += 3
            else:
                self.groups += 1
                self.out.append("(")
                self.i += 1
            return self.group_body()
        if c == ".":
            self.i += 1
            self.out.append("[^\\n\\r]")
            return None
        if c == "[":
            return self.char_class()
        if c == "\\":
            return self.out.append(self.escape(in_class=False))
        if c in ("*", "+", "?"):
            raise self.refuse(f"{c!r} at {self.i} repeats nothing (std::regex refuses it)")
        if c == "{":
            raise self.refuse(f"'{{' at {self.i} begins no repeat count (std::regex refuses it)")
        self.i += 1
        self.out.append(regex.escape(c))  # (a "]" or "}" alone is itself to both)
        return None

    def quantifier(self) -> None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.out.append(c)
            self.i += 1
        elif c == "{":
            j = self.i + 1
            lo = self._digits(j)
            if not lo:
                raise self.refuse(
                    f"'{self.p[self.i : self.i + 4]}...' is no repeat count to std::regex ({{n}}, {{n,}} or "
                    "{n,m}; it refuses {,n}), while Python reads one"
                )
            j += len(lo)
            hi = None
            if self.p[j : j + 1] == ",":
                j += 1
                hi = self._digits(j)
                j += len(hi)
            if self.p[j : j + 1] != "}":
                raise self.refuse(
                    f"a repeat count from {self.i} never closed with '}}' (std::regex refuses it)"
                )
            if hi and int(hi) < int(lo):
                raise self.refuse(f"the repeat count {{{lo},{hi}}}: its bounds in the wrong order")
            self.out.append(self.p[self.i : j + 1])
            self.i = j + 1
        else:
            return
        if self.peek() == "?":  # (lazy: the same to both)
            self.out.append("?")
            self.i += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._digits(self.i + 1)):
            raise self.refuse(
                f"a quantifier after a quantifier at {self.i} (std::regex repeats the repeat, Python makes it "
                "possessive or refuses it): put the first in a group"
            )

    def _digits(self, j: int) -> str:
        k = j
        while k < len(self.p) and self.p[k].isdigit() and self.p[k].isascii():
            k += 1
        return self.p[j:k]

    def escape(self, in_class: bool) -> str:
        """``\\X`` at ``self.i``: its Python spelling (past it)."""
        c = self.peek(1)
        if not c:
            raise self.refuse("a '\\' at the end (std::regex refuses it)")
        self.i += 2
        if c == "0":
            return "\\x00"
        if c.isdigit():
            raise self.refuse(
                f"the backreference '\\{c}' (std::regex and Python match it otherwise when its group takes no part)"
            )
        if c == "b" and in_class:
            return "\\x08"
        if c == "B" and in_class:
            raise self.refuse("'\\B' inside a class (std::regex and Python read it otherwise)")
        if c in _CONTROL:
            return _CONTROL[c]
        if c in _SHARED_ESCAPES:
            return "\\" + c
        if c == "c":
            letter = self.peek()
            if not (letter.isascii() and letter.isalpha()):
                raise self.refuse("'\\c' without a letter after it (std::regex refuses it)")
            self.i += 1
            return f"\\x{ord(letter) % 32:02x}"
        if c in ("x", "u"):
            width = 2 if c == "x" else 4
            digits = self.p[self.i : self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.refuse(f"'\\{c}' without {width} hex digits (std::regex refuses it)")
            value = int(digits, 16)
            if value > 0x7F:
                raise self.refuse(
                    f"'\\{c}{digits}': above 0x7f (std::regex compares the name's bytes, not characters)"
                )
            self.i += width
            return f"\\x{value:02x}"
        if c.isascii() and c.isalnum():
            raise self.refuse(
                f"'\\{c}' is the letter {c!r} to std::regex (llama-quantize) but something else, or nothing, to "
                f"Python: write {c!r}"
            )
        return regex.escape(c)

    def char_class(self) -> None:
        start = self.i
        self.i += 1
        out = ["["]
        if self.peek() == "^":
            out.append("^")
            self.i += 1
        if self.peek() == "]":
            raise self.refuse(f"the empty class '{self.p[start : self.i + 1]}' (Python has none)")
        while True:
            c = self.peek()
            if not c:
                raise self.refuse(f"the class from {start} never closed with ']' (std::regex refuses it)")
            if c == "]":
                self.i += 1
                break
            if c == "[" and self.peek(1) in (":", ".", "="):
                raise self.refuse(
                    f"the POSIX class '{self.p[self.i : self.i + 10]}...' (std::regex reads it, Python does not)"
                )
            if c == "\\":
                out.append(self.escape(in_class=True))
                continue
            if c == "-":
                out.append("\\-" if out[-1] in ("[", "^") or self.peek(1) == "]" else "-")
                self.i += 1
                continue
            out.append(regex.escape(c) if c in "[]\\^&~|" else c)
            self.i += 1
        out.append("]")
        self.out.append("".join(out))
