"""A variant's quality as its manifest states it: ``made_as`` (the llama-quantize command that makes its
bytes) carries comment lines after the command, one for the loss the set's cost tables predict and one
for the KL measured in llama.cpp; the card reads them back here (one owner of their spelling)."""

from __future__ import annotations

PREDICTED = "# predicted loss"  # (a line of ``made_as``: the loss the set's cost tables predict)
PREDICTED_WORDS = (
    "every tensor's measured cost under its type, summed (k3lab's cost tables of the set; the lossless set 0)"
)
MEASURED = "# KL from the lossless set"  # (a line of ``made_as``: llama-perplexity --kl-divergence's figures)


def measured_of(made_as: str) -> str | None:
    """The KL line's 99.9% figure and same-top share a variant's ``made_as`` states (None: none measured)."""
    for line in made_as.splitlines():
        if line.startswith(MEASURED + " "):
            got = dict(part.split(" ", 1) for part in line.split(": ", 1)[1].split(", ") if " " in part)
            return f"{got.get('99.9%', '?')} / {got.get('same-top', '?')}"
    return None


def predicted_of(made_as: str) -> str | None:
    """The predicted loss a variant's ``made_as`` states, as written (None when it states none)."""
    for line in made_as.splitlines():
        if line.startswith(PREDICTED + " "):
            return line[len(PREDICTED) + 1 :].split(":", 1)[0]
    return None
