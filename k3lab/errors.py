"""The one error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations


class K3LabError(ValueError):
    """Bad input: the message names the file and, where there is one, the tensor."""

    exit_code = 2

    def _render_traceback_(self) -> list[str]:
        """How IPython (a notebook's kernel) shows it: its lines, as the command line says them, not
        a traceback through k3lab's internals (the cell still fails: papermill and `k3lab batch`
        stop there and name it)."""
        lines = str(self).splitlines()[:20] or [""]
        return [f"{type(self).__name__}: {printable(line)}" for line in lines]


class MachineError(K3LabError):
    """The machine's problem, not the input's (a full disk): one line, exit 1."""

    exit_code = 1


def printable(text: str) -> str:
    """``text`` as it may reach a terminal: control and format characters (escape sequences, a
    carriage return, bidirectional overrides, zero-width marks) written as escapes, so a name read
    from a stranger's file says what it is and cannot rewrite the screen. Letters of any script stay."""
    import unicodedata

    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch == " " or unicodedata.category(ch) not in ("Cc", "Cf", "Co", "Cs", "Zl", "Zp"):
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)
