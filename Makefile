# Raylift. `make demo` and `make test` are the two commands a new user needs; each
# builds .venv by itself. torch is installed first, pinned, so nothing resolves a CUDA
# build on a CPU machine.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.raylift-installed
EXTRAS := train,tools,infra,dev,bench,track
TORCH := torch==2.13.0
PYTEST_ARGS ?=
# Two pytest workers, a file each at a time, longest first (tests/support/file_order.py;
# --no-loadscope-reorder keeps that order): most of a Ray test's time is single-threaded
# start-up (imports, polls), so a second stream fills the other core.
TEST_WORKERS ?= 2
# make test runs the benchmarks too, at smoke size (tests/bench/benchutil.py): a benchmark
# that no longer runs fails CI; its targets are judged only by make bench. Those that take
# minutes even at smoke size (marked bench_only) run in make bench alone: CI's 30 minutes.
TEST_PATHS ?= tests/unit tests/integration tests/bench
TEST_MARKS ?= not bench_only
# Integration cases CI leaves to make bench (bench_only; docs/development.md names each and
# what still covers it in CI): make bench runs them after the benchmarks.
BENCH_ONLY_TESTS ?= tests/integration
# Seconds one test may take (setup and teardown included) before it fails with every
# thread's stack: a deadlock is a red test, not a CI run that never ends. The longest
# test takes ~150 s here.
TEST_TIMEOUT ?= 600

.PHONY: setup demo test docs lint format bench gpu-check image push image-local image-check clean

setup: $(STAMP)

# Python keeps the bytecode it compiles, for every process make starts: where
# PYTHONDONTWRITEBYTECODE is set (this CI machine sets it), nothing compiled on import is
# kept, and every Ray worker, job driver and torchrun rank compiled again each module it
# imports: ~13 CPU-s for a training worker's libraries, ~1 s for this repository's own
# modules, in each process. Unexported, the first
# process to import a module writes its .pyc (atomically) and the rest read it, so only
# what is imported is ever compiled (pip installs without compiling, which would take
# ~100 s for the whole venv, most of it never imported).
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet pip==26.3
	$(BIN)/python -m pip install --quiet --no-compile $(TORCH)
	$(BIN)/python -m pip install --quiet --no-compile -e '.[$(EXTRAS)]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m tools.demo

test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	RAYLIFT_BENCH_SMOKE=1 RAYLIFT_TEST_PREBUILD_CPU_ADAM=1 \
		$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--timeout $(TEST_TIMEOUT) -m '$(TEST_MARKS)' $(TEST_PATHS) --durations=30 $(PYTEST_ARGS)

# The docs site (mkdocs, material theme): every link and anchor checked (--strict).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -d build/site

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .

format: $(STAMP)
	$(BIN)/python -m ruff format .
	$(BIN)/python -m ruff check --fix .

bench: $(STAMP)
	RAYLIFT_BENCH_SMOKE= RAYLIFT_RAY_DEFAULTS=1 $(BIN)/python -m pytest tests/bench -s -o testpaths=tests/bench
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--timeout $(TEST_TIMEOUT) -m bench_only $(BENCH_ONLY_TESTS)

# Every GPU path (strategies × 1 GPU and all GPUs, bf16) trained, resumed, exported and
# measured against the planner: docs/gpu-check.md. Without CUDA: the CPU
# self-check. GPUCHECK_ARGS: e.g. --only ddp fsdp, --peak-tflops 989, --layers 8.
gpu-check: $(STAMP)
	$(BIN)/python -m tools.gpucheck $(GPUCHECK_ARGS)

# Engine: Docker BuildKit where one answers, buildah otherwise (RAYLIFT_IMAGE_ENGINE picks);
# the first line of output names it. images/README.md has the settings (IMAGE_ARGS).
image: $(STAMP)
	$(BIN)/python tools/image.py build $(IMAGE_ARGS)

push: $(STAMP)
	$(BIN)/python tools/image.py push $(IMAGE_ARGS)

# What a machine that reaches only PyPI and Debian can build: a Debian 12 OS image made with
# mmdebstrap, torch's CPU wheel from a local wheelhouse (PyPI's torch is the CUDA build).
LOCAL_OS_IMAGE ?= localhost/debian:bookworm-slim
WHEELHOUSE ?= build/torch-cpu-wheels
LOCAL_IMAGE_ARGS = --os-image $(LOCAL_OS_IMAGE) --torch-index-url '' --wheelhouse $(WHEELHOUSE)
$(WHEELHOUSE):
	$(BIN)/python -m pip download --quiet --no-deps -d $(WHEELHOUSE) $(TORCH)

image-local: $(STAMP) | $(WHEELHOUSE)
	$(BIN)/python tools/image.py os-image --tag $(LOCAL_OS_IMAGE)
	$(BIN)/python tools/image.py build --variant cpu $(LOCAL_IMAGE_ARGS) $(IMAGE_ARGS)

# The GPU chain, built here as far as it goes (about 3 GB of CUDA wheels; not in CI), then
# every trainer module and bitsandbytes imported inside the result.
image-check: $(STAMP) | $(WHEELHOUSE)
	$(BIN)/python tools/image.py os-image --tag $(LOCAL_OS_IMAGE)
	$(BIN)/python tools/image.py check --variant gpu --os-image $(LOCAL_OS_IMAGE) $(IMAGE_ARGS)

clean:
	rm -rf build .pytest_cache .ruff_cache
