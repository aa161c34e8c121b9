"""llama.cpp's own source tree as a judge: the tree the llama-cpp-python 0.3.36 sdist vendors (the same
llama.cpp ``make test`` builds the Python binding from), fetched once with ``pip download`` and built
in pieces the tests need, cached under ``~/.cache/k3lab/upstream-judge/``:

- ``vendor_tree()``: the tree (upstream's converter, gguf-py, the sources);
- ``jinja_engine()``: llama.cpp's Jinja engine (``common/jinja``: lexer, parser, runtime, the caps
  llama-server derives) compiled with a small driver of k3lab's (``tests/llama_jinja.cpp``) that
  renders one context per input line, as ``common_chat_template`` parses a template and
  ``common_chat_template_direct_apply`` renders it (about 40 s to build, once);
- ``llama_server()``: the real ``llama-server`` (``POST /apply-template`` and chat), built with
  CMake (several minutes on two cores: the slow tests use it);
- ``llama_quantize()``: the real ``llama-quantize`` (``tools/quantize`` and the pieces of ``common``
  it uses), linked against the libllama and libggml llama-cpp-python installed (the kernels k3lab
  calls: about 15 s to build, once);
- ``llama_imatrix()``: the real ``llama-imatrix`` the same way (all of ``common``: a few minutes, once).
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


FORK_ENV = "K3LAB_FORK_TREE"  # a checkout of unsloth's llama.cpp fork (github.com/unslothai/llama.cpp)


def fork_tree() -> Path:
    """unsloth's llama.cpp fork, the one that runs Kimi-K3's vision (its ``kimi-k3-vision-only``
    branch, edfd4c1; ``K3LAB_FORK_TREE``, else k3lab's judge cache's ``unsloth-llama.cpp``): skipped,
    loudly, where it is not (nothing fetches it: GitHub is not PyPI)."""
    tree = Path(os.environ.get(FORK_ENV) or CACHE / "unsloth-llama.cpp")
    if not (tree / "common" / "jinja" / "parser.cpp").exists():
        pytest.skip(
            f"SKIPPED LOUDLY: no unsloth llama.cpp tree at {tree} (git clone -b kimi-k3-vision-only "
            f"https://github.com/unslothai/llama.cpp, git checkout edfd4c1, and set {FORK_ENV})"
        )
    return tree


def jinja_engine(tree: Path | None = None) -> Path:
    """llama.cpp's Jinja engine behind k3lab's driver, built once per driver source and tree (the
    vendored one by default)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: llama.cpp's template engine cannot be built")
    vendor = tree or vendor_tree()
    engine = sorted((vendor / "common" / "jinja").glob("*.[ch]*"))  # (the tree's engine, by its bytes)
    digest = (
        __import__("hashlib").sha256(b"".join(p.read_bytes() for p in [DRIVER, *engine])).hexdigest()[:12]
    )
    binary = CACHE / f"llama-jinja-{digest}"
    if not binary.exists():
        sources = sorted(str(p) for p in (vendor / "common" / "jinja").glob("*.cpp"))
        sources += [
            str(p) for p in (vendor / "common" / "json.cpp", vendor / "common" / "unicode.cpp") if p.exists()
        ]
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

    def __init__(self, template: str, tree: Path | None = None):
        self.binary = jinja_engine(tree)
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


def fork_server(target: str = "llama-server") -> Path:
    """``llama-server`` (or ``llama-mtmd-cli``) of unsloth's fork (``fork_tree``), built once: where
    K3's vision runs."""
    return llama_server(fork_tree(), CACHE / "fork-server-build", target)


def llama_server(tree: Path | None = None, build: Path | None = None, target: str = "llama-server") -> Path:
    """``llama-server`` (or another tool, ``target``) of the vendored tree (or ``tree``; CPU, no web
    UI, nothing fetched), built once."""
    if shutil.which("cmake") is None or shutil.which("g++") is None:
        pytest.skip("cmake or g++ is not installed: llama-server cannot be built")
    vendor = tree or vendor_tree()
    build = build or CACHE / "server-build"
    binary = build / "bin" / target
    if not binary.exists():
        _run(
            ["cmake", "-S", str(vendor), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
             "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
             "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF",
             "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
        )  # fmt: skip
        _run(
            ["cmake", "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 2)],
            timeout=3600,
        )
    return binary


def _installed_lib() -> Path:
    """llama-cpp-python's own libllama and libggml (the tools below link against them)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama-cpp-python is not installed: llama.cpp's tools cannot be built against it")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _tool(name: str, sources: list[Path]) -> Path:
    """A tool of the vendored tree, compiled (objects in parallel, cached by the sources' names) and
    linked against llama-cpp-python's libraries."""
    if shutil.which("g++") is None:
        pytest.skip(f"g++ is not installed: {name} cannot be built")
    vendor, lib = vendor_tree(), _installed_lib()
    digest = __import__("hashlib").sha256(("\n".join(map(str, sources)) + str(lib)).encode()).hexdigest()[:12]
    binary = CACHE / f"{name}-{digest}"
    if binary.exists():
        return binary
    # (one folder of objects for every tool: common's are the same files with the same flags, compiled once)
    objs = CACHE / f"tool-objs-{__import__('hashlib').sha256(str(lib).encode()).hexdigest()[:12]}"
    objs.mkdir(parents=True, exist_ok=True)
    info = objs / "build-info.cpp"
    info.write_text(
        (vendor / "common" / "build-info.cpp.in").read_text()
        .replace("@LLAMA_BUILD_NUMBER@", "0").replace("@LLAMA_BUILD_COMMIT@", "llama-cpp-python-0.3.36")
        .replace("@BUILD_COMPILER@", "g++").replace("@BUILD_TARGET@", "k3lab-tests")
    )  # fmt: skip
    includes = ["-I", str(vendor / "include"), "-I", str(vendor / "ggml" / "include"), "-I",
                str(vendor / "common"), "-I", str(vendor / "vendor")]  # fmt: skip
    from concurrent.futures import ThreadPoolExecutor

    def compile_one(src: Path) -> Path:
        obj = objs / (__import__("hashlib").sha256(str(src).encode()).hexdigest()[:16] + ".o")
        if not obj.exists():
            part = obj.with_suffix(".part")
            _run(["g++", "-std=c++17", "-O1", "-ffunction-sections", "-fdata-sections", *includes, "-c",
                  str(src), "-o", str(part)], timeout=900)  # fmt: skip
            os.replace(part, obj)
        return obj

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        built = list(pool.map(compile_one, [*sources, info]))
    partial = binary.with_suffix(".partial")
    _run(["g++", *map(str, built), f"-L{lib}", "-lllama", "-lggml", "-lggml-base", "-Wl,--gc-sections",
          f"-Wl,-rpath,{lib}", "-o", str(partial)], timeout=900)  # fmt: skip
    os.replace(partial, binary)
    return binary


def llama_quantize() -> Path:
    """``llama-quantize`` of the vendored tree: its own main and quantize.cpp, common's imatrix loader,
    common.cpp, log.cpp and json.cpp (what it calls), on llama-cpp-python's libllama and libggml."""
    v = vendor_tree()
    return _tool(
        "llama-quantize",
        [v / "tools" / "quantize" / "main.cpp", v / "tools" / "quantize" / "quantize.cpp"]
        + [v / "common" / f for f in ("imatrix-loader.cpp", "common.cpp", "log.cpp", "json.cpp")],
    )


def llama_imatrix() -> Path:
    """``llama-imatrix`` of the vendored tree, on llama-cpp-python's libraries (all of ``common``)."""
    v = vendor_tree()
    common = sorted(p for d in ("", "jinja", "parsers") for p in (v / "common" / d).glob("*.cpp"))
    return _tool(
        "llama-imatrix",
        [v / "tools" / "imatrix" / "imatrix.cpp", v / "vendor" / "cpp-httplib" / "httplib.cpp"]
        + [p for p in common if p.name != "llguidance.cpp"],
    )


def llama_perplexity() -> Path:
    """``llama-perplexity`` of the vendored tree (its ``--kl-divergence``: the figures publishers report),
    on llama-cpp-python's libraries (all of ``common``)."""
    v = vendor_tree()
    common = sorted(p for d in ("", "jinja", "parsers") for p in (v / "common" / d).glob("*.cpp"))
    return _tool(
        "llama-perplexity",
        [
            v / "tools" / "perplexity" / "main.cpp",
            v / "tools" / "perplexity" / "perplexity.cpp",
            v / "vendor" / "cpp-httplib" / "httplib.cpp",
        ]
        + [p for p in common if p.name != "llguidance.cpp"],
    )


def quantize_like_llama(first: Path, out: Path, ftype: str, *flags: str, keep_split: bool = True) -> str:
    """``llama-quantize [--keep-split] --allow-requantize FLAGS FIRST OUT FTYPE``; its log."""
    cmd = [str(llama_quantize()), *(["--keep-split"] if keep_split else []), "--allow-requantize", *flags,
           str(first), str(out), ftype]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=1800)
    if done.returncode:
        pytest.fail(f"llama-quantize {ftype} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout + done.stderr


def std_regex_judge() -> Path:
    """``tests/std_regex_judge.cpp`` built (seconds, once): std::regex of this machine's C++ library,
    the one llama-quantize's patterns are compiled with."""
    import hashlib

    source = Path(__file__).with_name("std_regex_judge.cpp")
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: the std::regex judge cannot be built")
    binary = CACHE / f"std-regex-judge-{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}"
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        _run(["g++", "-std=c++17", "-O1", str(source), "-o", str(partial)], timeout=600)
        os.replace(partial, binary)
    return binary
