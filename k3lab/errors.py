"""The one error type the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations


class K3LabError(ValueError):
    """Bad input: the message names the file and, where there is one, the tensor."""

    exit_code = 2


class MachineError(K3LabError):
    """The machine's problem, not the input's (a full disk): one line, exit 1."""

    exit_code = 1
