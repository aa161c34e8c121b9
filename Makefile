# The README's two set-up commands live here so that README, CI and developers run the same thing.
PY ?= python3
# llama-cpp-python builds llama.cpp from source: only the library the binding needs, generic AVX2
# code (the wheel pip caches then runs on any x86-64 machine of this kind), both cores.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: demo test test-slow bench lint
demo:
	$(PY) -m pip install -e . && k3lab demo

test:
	$(PY) -m pip install -e '.[test,llama]' && $(PY) -m pytest

test-slow:
	$(PY) -m pytest -m slow

bench:
	$(PY) benchmarks/run.py

lint:
	ruff check . && ruff format --check .
