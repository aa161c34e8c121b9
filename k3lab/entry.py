"""The ``k3lab`` command's entry point: ``cli.main``, then out without tearing the interpreter down."""

from __future__ import annotations

import atexit
import os
import sys
import threading

from k3lab.cli import main


def run() -> None:
    """The ``k3lab`` command: ``main``, then out without tearing the interpreter down when nothing is
    left running (every module and object freed one by one, numba's and LLVM's among them: 0.15 s
    after a conversion, paid by every file a worker process is started for). Output is flushed and
    the exit handlers run (temporary folders, multiprocessing's) as at any exit; a thread still
    running (none should be) gets the ordinary exit, which waits for it."""
    code = main()
    hashing = sys.modules.get("k3lab.formats.hashing")  # (not imported for it: numpy's 0.1 s)
    if hashing is not None:
        hashing.stop()  # its idle thread would otherwise count as running, below
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # (a closed pipe: nothing more can be said)
            pass
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    os._exit(code)
