# attnres: `make test` and `make demo` do their own set-up (idempotent):
# a venv in .venv with torch and the test tools, the editable extension
# build, and the CMake build of the C++ tests against the same LibTorch.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
export MAX_JOBS ?= 2
BUILD_CPP := build-cpp
CSRC := $(shell find csrc -type f) setup.py
CMAKE_SRC := $(CSRC) CMakeLists.txt $(shell find tests/cpp -type f 2>/dev/null)

.PHONY: test demo bench setup build py-test cpp-test sysdeps clean info

test: py-test cpp-test

demo: build
	$(VPY) -m attnres demo

bench: build
	$(VPY) benchmarks/bench_op.py

info: build
	$(VPY) -m attnres info

setup: $(VENV)/.stamp-deps
build: $(VENV)/.stamp-build

# System tools the C++ side needs (present on this machine kind; installed
# with apt-get only when missing).
sysdeps:
	@command -v cmake >/dev/null && command -v g++ >/dev/null && [ -f /usr/include/gtest/gtest.h ] \
	  || (apt-get update && apt-get install -y --no-install-recommends cmake g++ libgtest-dev)

$(VENV)/.stamp-deps: requirements-dev.txt
	@[ -x $(VPY) ] || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements-dev.txt
	@touch $@

$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(CSRC)
	$(VPY) -m pip install -q --no-build-isolation -e .
	$(VPY) -m attnres info  # what the build decided: CPU and CUDA kernels compiled in
	@touch $@

py-test: build
	ATTNRES_SLOW_TESTS=1 $(VPY) -m pytest -q -p no:cacheprovider tests/python

$(BUILD_CPP)/.stamp: $(VENV)/.stamp-deps $(CMAKE_SRC) | sysdeps
	cmake -S . -B $(BUILD_CPP) -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_PREFIX_PATH="$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')"
	cmake --build $(BUILD_CPP) -j $(MAX_JOBS)
	@touch $@

cpp-test: $(BUILD_CPP)/.stamp
	ctest --test-dir $(BUILD_CPP) --output-on-failure

clean:
	rm -rf $(BUILD_CPP) build python/attnres/*.so python/*.egg-info $(VENV)/.stamp-build
