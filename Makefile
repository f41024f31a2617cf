# A thin front end over CMake. The build itself is CMakeLists.txt.
#
#   make            install missing dependencies, configure, build
#   make demo       ... and run the demo
#   make test       ... and run all tests
#   make test-asan  the CPU tests under AddressSanitizer + UBSan (clang,
#                   build-asan/, which also holds the fuzz targets)
#   make test-tsan  the CPU tests under ThreadSanitizer (build-tsan/)
#   make fuzz       each fuzz target for FUZZ_SECONDS (60) under libFuzzer,
#                   FUZZ_JOBS (the CPUs) targets at a time,
#                   ASan and UBSan (build-asan/); inputs it finds stay in
#                   build-asan/corpus, crashes in build-asan/crashes
#   make check      test, test-asan, test-tsan and fuzz: what CI runs
#   make bench      build and run the benchmark
#   make install    install into $(PREFIX)
#   make clean      remove the build directories
#
# Variables: BUILD (build directory), JOBS, PREFIX, CMAKE_ARGS (extra
# -D options for CMake; given, they are applied to an existing build too).

BUILD ?= build
JOBS ?= 2
PREFIX ?= /usr/local
CMAKE ?= cmake
CTEST ?= ctest
CMAKE_ARGS ?=
CTEST_ARGS ?=
# Sanitizer builds: CPU only, with line numbers in the reports.
SANITIZER_CMAKE_ARGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWKV_CUDA=OFF

FUZZ_SECONDS ?= 60
# Fuzz targets run side by side, this many at a time (default: the CPUs).
FUZZ_JOBS ?=
FUZZ_ARGS ?=
# The ASan + UBSan build is clang's, with libFuzzer's coverage: one build
# serves the sanitized suite and the fuzz targets.
ASAN_CMAKE_ARGS ?= -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DWKV_SANITIZE=address -DWKV_FUZZ=ON $(SANITIZER_CMAKE_ARGS)

CTEST_FLAGS = --output-on-failure -j$(JOBS) --timeout 600 $(CTEST_ARGS)

export ASAN_OPTIONS ?= abort_on_error=0:detect_leaks=1:allocator_may_return_null=1
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS ?= halt_on_error=1:second_deadlock_stack=1:allocator_may_return_null=1

.PHONY: all deps configure build test asan-build test-asan test-tsan fuzz check demo bench install clean help

all: build

deps:
	@bash tools/install-deps.sh

# configure-in <dir> <extra cmake args>: configure when the directory has no
# cache yet, or when extra arguments were given.
define configure-in
	@if [ ! -f "$(1)/CMakeCache.txt" ] || [ -n "$(strip $(2))" ]; then \
	  echo "$(CMAKE) -S . -B $(1) $(strip $(2))"; \
	  $(CMAKE) -S . -B "$(1)" $(2); \
	fi
endef

configure: deps
	$(call configure-in,$(BUILD),$(CMAKE_ARGS))

build: configure
	$(CMAKE) --build "$(BUILD)" -j $(JOBS)

test: build
	$(CTEST) --test-dir "$(BUILD)" $(CTEST_FLAGS)

asan-build: deps
	$(call configure-in,build-asan,$(ASAN_CMAKE_ARGS) $(CMAKE_ARGS))
	$(CMAKE) --build build-asan -j $(JOBS)

test-asan: asan-build
	$(CTEST) --test-dir build-asan -L cpu $(CTEST_FLAGS)

test-tsan: deps
	$(call configure-in,build-tsan,-DWKV_SANITIZE=thread $(SANITIZER_CMAKE_ARGS) $(CMAKE_ARGS))
	$(CMAKE) --build build-tsan -j $(JOBS)
	$(CTEST) --test-dir build-tsan -L cpu $(CTEST_FLAGS)

# Each tests/fuzz/fuzz_<name>.cpp runs from its seed corpus
# (tests/fuzz/corpus/<name>, read only) plus what earlier runs found.
fuzz: asan-build
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_JOBS=$(FUZZ_JOBS) bash tools/run-fuzz.sh build-asan $(FUZZ_ARGS)

check: test test-asan test-tsan fuzz

demo: build
	"$(BUILD)/bin/wavekv" demo

bench: build
	"$(BUILD)/bin/wavekv" bench

install: build
	$(CMAKE) --install "$(BUILD)" --prefix "$(PREFIX)"

clean:
	rm -rf "$(BUILD)" build-asan build-tsan

help:
	@sed -n '3,19p' Makefile
