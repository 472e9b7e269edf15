# kiln: `make demo` and `make test` work from a fresh clone with only python3 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip --disable-pip-version-check
TORCH_VERSION := 2.13.0
LLAMA_CPP_VERSION := 0.3.36
# This CPU kind advertises AMX but faults on it: build llama.cpp for AVX2 and cap oneDNN at AVX512-BF16.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# pip's wheel cache does not key on CMAKE_ARGS, so the built wheel is kept here: outside the checkout, as the
# runtimes are, so a fresh clone (and CI) on this machine installs it in seconds instead of building it again.
KILN_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kiln
WHEELHOUSE ?= $(KILN_CACHE)/wheelhouse
LLAMA_WHEEL := $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_CPP_VERSION)-py3-none-linux_x86_64.whl
export ONEDNN_MAX_CPU_ISA := AVX512_CORE_BF16

RECIPE := examples/tiny-llama/kiln.yaml
# The demo's publisher key: TEST ONLY (published in this repository; see examples/tiny-llama/signing/).
DEMO_KEY := examples/tiny-llama/signing/TEST-ONLY-key.pem
REGISTRY_DIR := .kiln/registry

.PHONY: install runtimes demo test test-fast lint bench clean

install: $(VENV)/.installed

# vLLM's own environment (its pins clash with kiln's): installed once under KILN_RUNTIMES
# (~/.cache/kiln/runtimes), outside the checkout, so fresh clones and CI find it; a no-op when it is there.
runtimes: install
	$(BIN)/kiln runtime install vllm

$(VENV)/.installed: pyproject.toml constraints.txt $(LLAMA_WHEEL)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q --no-deps $(LLAMA_WHEEL)
	$(PIP) install -q -c constraints.txt -e ".[build,postgres,s3,ray,dev]"
	touch $@

$(LLAMA_WHEEL):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	mkdir -p $(WHEELHOUSE)
	@echo "building llama-cpp-python $(LLAMA_CPP_VERSION) for AVX2 (about 10 minutes, once)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) wheel -q --no-deps --no-cache-dir -w $(WHEELHOUSE) llama-cpp-python==$(LLAMA_CPP_VERSION)

demo: runtimes
	$(BIN)/kiln build $(RECIPE)
	$(BIN)/kiln keys add $(DEMO_KEY).pub --model tiny-llama --registry $(REGISTRY_DIR)
	$(BIN)/kiln publish $(RECIPE) --registry $(REGISTRY_DIR) --signing-key $(DEMO_KEY)
	$(BIN)/kiln verify tiny-llama@1.0.0/gguf-q4_k_m --key $(DEMO_KEY).pub --registry $(REGISTRY_DIR)
	$(BIN)/kiln promote tiny-llama@1.0.0 --channel prod --registry $(REGISTRY_DIR)
	$(BIN)/kiln resolve tiny-llama --hardware cpu --channel prod --registry $(REGISTRY_DIR)
	$(BIN)/kiln resolve tiny-llama --hardware tpu-v5e --channel prod --registry $(REGISTRY_DIR)

# One worker per core (at most 4: each may hold a vLLM worker and a model), a test file per worker at a time
# (its module fixtures are built once); the timing tests compare wall times, so they run alone, after.
TEST_WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)

test: runtimes
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not timing" --durations=25
	$(BIN)/pytest -q -m timing

test-fast: runtimes
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not timing"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy kiln  # every package, through its link in kiln/
	$(BIN)/lint-imports
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
	$(BIN)/zizmor --offline --min-severity medium .github/workflows/

bench: install
	$(BIN)/python bench/gguf_convert.py

clean:
	rm -rf .kiln
