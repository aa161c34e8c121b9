"""llama.cpp's own source tree as a judge: the tree the llama-cpp-python 0.3.36 sdist vendors (the same
llama.cpp ``make test`` builds the Python binding from), fetched once with ``pip download`` and built
in pieces the tests need, cached under ``~/.cache/k3lab/upstream-judge/``:

- ``vendor_tree()``: the tree (upstream's converter, gguf-py, the sources);
- ``jinja_engine()``: llama.cpp's Jinja engine (``common/jinja``: lexer, parser, runtime, the caps
  llama-server derives) compiled with a small driver of k3lab's (``tests/llama_jinja.cpp``) that
  renders one context per input line, as ``common_chat_template`` parses a template and
  ``common_chat_template_direct_apply`` renders it (about 40 s to build, once);
- ``llama_server()``: the real ``llama-server`` (``POST /apply-template`` and chat), built with
  CMake (several minutes on two cores: the slow tests use it).
Nothing of llama.cpp is copied into k3lab.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("K3LAB_JUDGE_CACHE", Path.home() / ".cache" / "k3lab" / "upstream-judge"))
DRIVER = Path(__file__).with_name("llama_jinja.cpp")


def _run(cmd: list[str], timeout: float = 1800, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if done.returncode:
        pytest.fail(f"{' '.join(cmd[:6])}... failed:\n{done.stderr[-3000:]}")
    return done


def vendor_tree() -> Path:
    """The vendored llama.cpp tree, fetched and unpacked once."""
    vendor = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    if not (vendor / "convert_hf_to_gguf.py").exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                SDIST,
                "-d",
                str(CACHE),
            ]
        )
        with tarfile.open(next(CACHE.glob("llama_cpp_python-0.3.36.tar.gz"))) as tar:
            tar.extractall(CACHE, filter="data")
    return vendor


def jinja_engine() -> Path:
    """llama.cpp's Jinja engine behind k3lab's driver, built once per driver source."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: llama.cpp's template engine cannot be built")
    vendor = vendor_tree()
    digest = __import__("hashlib").sha256(DRIVER.read_bytes()).hexdigest()[:12]
    binary = CACHE / f"llama-jinja-{digest}"
    if not binary.exists():
        sources = sorted(str(p) for p in (vendor / "common" / "jinja").glob("*.cpp"))
        sources += [str(vendor / "common" / "json.cpp"), str(vendor / "common" / "unicode.cpp")]
        partial = binary.with_suffix(".partial")
        _run(
            ["g++", "-std=c++17", "-O1", "-I", str(vendor / "common"), "-I", str(vendor / "vendor"),
             "-I", str(vendor / "ggml" / "include"), str(DRIVER), *sources, "-o", str(partial)],
            timeout=900,
        )  # fmt: skip
        os.replace(partial, binary)
    return binary


class JinjaEngine:
    """One llama.cpp engine process per template: ``caps`` (what llama-server derives from the
    template) and ``render(contexts)`` -> per context {"text": ...} or {"error": ...}."""

    def __init__(self, template: str):
        self.binary = jinja_engine()
        self.template = template.encode()
        self.caps = self._call([])[0]

    def _call(self, contexts: list[dict]) -> list[dict]:
        lines = b"".join(json.dumps(c, ensure_ascii=False).encode() + b"\n" for c in contexts)
        done = subprocess.run(
            [str(self.binary)],
            input=str(len(self.template)).encode() + b"\n" + self.template + b"\n" + lines,
            capture_output=True,
            timeout=120 + len(contexts),
        )
        answers = [
            json.loads(line) for line in done.stdout.split(b"\n") if line
        ]  # (not splitlines: U+2028 is text)
        if done.returncode or len(answers) != len(contexts) + 1:
            pytest.fail(f"llama.cpp's engine stopped: {done.stderr.decode(errors='replace')[-2000:]}")
        return answers

    def render(self, contexts: list[dict]) -> list[dict]:
        return self._call(contexts)[1:]


def llama_server() -> Path:
    """``llama-server`` of the vendored tree (CPU, no web UI, nothing fetched), built once."""
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        pytest.skip("cmake or g++ is not installed: llama-server cannot be built")
    vendor = vendor_tree()
    build = CACHE / "server-build"
    binary = build / "bin" / "llama-server"
    if not binary.exists():
        _run(
            ["cmake", "-S", str(vendor), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
             "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF",
             "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
        )  # fmt: skip
        _run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
            timeout=3600,
        )
    return binary
