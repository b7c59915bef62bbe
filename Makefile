# attnres: `make test` and `make demo` do their own set-up (idempotent):
# a venv in .venv with torch and the test tools, then one CMake build (in
# build-cmake, driven by pip's editable install) of the op library, the
# Python extension and the C++ tests against the venv's LibTorch.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
export MAX_JOBS ?= 2
BUILD := build-cmake
BUILD_INPUTS := $(shell find csrc cmake tests/cpp -path tests/cpp/aoti -prune -o -type f -print) \
  setup.py CMakeLists.txt pyproject.toml \
  python/attnres/_version.py

.PHONY: test test-fast demo bench setup build py-test cpp-test cpp-install cpp-example sysdeps clean info fuzz sanitize sanitize-full FORCE

test: py-test cpp-test cpp-example

# Skips the tests marked slow (the inductor compiles): for quick local runs.
test-fast: build
	$(VPY) -m pytest -q -p no:cacheprovider -m "not slow" tests/python
	ctest --test-dir $(BUILD) --output-on-failure

demo: build
	$(VPY) -m attnres demo

bench: build
	$(VPY) benchmarks/bench.py --device cpu

# Long property-based run (hypothesis, random examples) against the tests'
# float64 implementation, for ATTNRES_FUZZ_SECONDS (default 600).
fuzz: build
	ATTNRES_HYPOTHESIS_PROFILE=fuzz ATTNRES_FUZZ_SECONDS=$${ATTNRES_FUZZ_SECONDS:-600} \
	  $(VPY) -m pytest -q -p no:cacheprovider tests/python/test_properties.py

# The C++ tests and the CUDA-kernel emulation built with ASan+UBSan (a
# CPU-only build of its own in build-sanitize) and run.
sanitize: setup | sysdeps
	PYTHON=$(abspath $(VPY)) MAX_JOBS=$(MAX_JOBS) tests/sanitize/run.sh

# The same with the kernel emulation of every dtype sanitized (fp64 and fp16 too).
sanitize-full: setup | sysdeps
	ATTNRES_SANITIZE_DTYPES="float64 float32 bfloat16 float16" \
	  PYTHON=$(abspath $(VPY)) MAX_JOBS=$(MAX_JOBS) tests/sanitize/run.sh

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

# The GPU arch list of the build (TORCH_CUDA_ARCH_LIST, written only when it
# changes): another list rebuilds (.ci/run compiles sm_90 alone).
ARCHS_STAMP := $(VENV)/.stamp-cuda-archs
$(ARCHS_STAMP): FORCE | $(VENV)/.stamp-deps
	@printf '%s\n' "$$TORCH_CUDA_ARCH_LIST" | cmp -s - $@ || printf '%s\n' "$$TORCH_CUDA_ARCH_LIST" > $@
FORCE:

# One compile for everything: the editable install runs CMake in $(BUILD)
# with the C++ tests enabled, and ctest reuses that build.
$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(ARCHS_STAMP) $(BUILD_INPUTS) | sysdeps
	ATTNRES_BUILD_DIR=$(BUILD) ATTNRES_BUILD_TESTS=1 $(VPY) -m pip install -q --no-build-isolation -e .
	$(VPY) -m attnres info  # what the build decided: CPU and CUDA kernels compiled in
	@touch $@

# The C++ AOTInductor test (tests/python/test_export.py) consumes the
# installed package, so it is installed first.
py-test: build cpp-install
	ATTNRES_REQUIRE_INSTALL=1 ATTNRES_INSTALL_PREFIX=$(CPP_PREFIX) \
	  $(VPY) -m pytest -q -p no:cacheprovider tests/python

cpp-test: build
	ctest --test-dir $(BUILD) --output-on-failure

# The installed CMake package, consumed out of tree: install the library,
# headers and attnresConfig.cmake from $(BUILD) into $(BUILD)/install, then
# configure, build and run examples/cpp against it (find_package(attnres)).
CPP_PREFIX := $(abspath $(BUILD))/install
cpp-install: build
	cmake --install $(BUILD) --prefix $(CPP_PREFIX)

cpp-example: cpp-install
	cmake -S examples/cpp -B $(BUILD)/examples \
	  -DCMAKE_PREFIX_PATH="$(CPP_PREFIX);$$($(VPY) -c 'import torch; print(torch.utils.cmake_prefix_path)')"
	cmake --build $(BUILD)/examples -j $(MAX_JOBS)
	$(BUILD)/examples/grad_check
	$(BUILD)/examples/tiny_model

clean:
	rm -rf $(BUILD) build-sanitize build dist python/attnres/*.so python/*.egg-info $(VENV)/.stamp-build
