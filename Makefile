# The README's set-up commands live here so that README, CI and developers run the same thing.
# Outside a virtual environment, everything installs into ./.venv (current Debian and Ubuntu refuse
# pip installs into the system Python, PEP 668); inside one (VIRTUAL_ENV set), that one is used.
ifeq ($(VIRTUAL_ENV),)
VENV := $(CURDIR)/.venv
export PATH := $(VENV)/bin:$(PATH)
PY := $(VENV)/bin/python
else
VENV :=
PY := python
endif
# llama-cpp-python builds llama.cpp from source: only the library the binding needs, generic AVX2
# code (the wheel pip caches then runs on any x86-64 machine of this kind), both cores.
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: demo test test-slow bench lint lab venv docs
venv:
	@if [ -n "$(VENV)" ] && [ ! -x "$(PY)" ]; then python3 -m venv "$(VENV)"; fi

# pip runs when pyproject.toml changed since the last install into this environment (the package is
# installed editable: code changes need none), so a second `make demo` takes the demo's seconds
STAMPS := $(if $(VENV),$(VENV),$(VIRTUAL_ENV))

$(STAMPS)/.k3lab-installed: pyproject.toml | venv
	$(PY) -m pip install -e . && touch $@

# the demo's llama.cpp (k3lab's quantiser and imatrix kernels, the chat): llama-cpp-python compiles it,
# once; where it cannot (no compiler), the demo runs without those steps and says so
$(STAMPS)/.k3lab-installed-demo: $(STAMPS)/.k3lab-installed
	@echo "k3lab: building llama.cpp through llama-cpp-python (about 10 minutes on 2 cores, once)"
	@$(PY) -m pip install -v -e '.[llama]' 2>&1 | $(PY) .ci/build-progress; \
	  $(PY) -c "import llama_cpp" 2>/dev/null \
	  || echo "k3lab: llama.cpp could not be built here (a C and C++ compiler?): the demo runs without its variant and chat"
	@touch $@

$(STAMPS)/.k3lab-installed-test: pyproject.toml | venv
	$(PY) -m pip install -e '.[test,llama]' && touch $@ $(STAMPS)/.k3lab-installed $(STAMPS)/.k3lab-installed-demo

demo: $(STAMPS)/.k3lab-installed-demo
	k3lab demo

test: $(STAMPS)/.k3lab-installed-test
	$(PY) -m pytest

test-slow: venv
	$(PY) -m pytest -m slow

bench: venv
	$(PY) benchmarks/run.py

lab: venv
	k3lab lab

# the generated reference pages, made again from the code (tests/unit/test_docs.py fails when one is stale)
docs: venv
	k3lab tensor-map > TENSOR_MAP.md
	$(PY) -m k3lab.cli_reference > docs/reference/cli.md
	$(PY) -m k3lab.metadata_reference text > docs/reference/metadata.md
	$(PY) -m k3lab.metadata_reference mmproj > docs/reference/mmproj.md
	$(PY) -m k3lab.state_reference > docs/reference/on-disk-state.md

lint: venv
	ruff check . && ruff format --check .
