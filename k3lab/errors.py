"""The one error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations


class K3LabError(ValueError):
    """Bad input: the message names the file and, where there is one, the tensor."""
