# A thin front end over CMake. The build itself is CMakeLists.txt.
#
#   make            install missing dependencies, configure, build
#   make demo       ... and run the demo
#   make test       ... and run all tests
#   make test-asan  the CPU tests under AddressSanitizer + UBSan (build-asan/)
#   make test-tsan  the CPU tests under ThreadSanitizer (build-tsan/)
#   make fuzz       the libFuzzer targets (clang, ASan + UBSan, build-fuzz/),
#                   FUZZ_SECONDS (60) each, from tests/fuzz/corpus/<target>
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

CTEST_FLAGS = --output-on-failure -j$(JOBS) --timeout 600 $(CTEST_ARGS)

export ASAN_OPTIONS ?= abort_on_error=0:detect_leaks=1
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS ?= halt_on_error=1:second_deadlock_stack=1

FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= file_reader
# libFuzzer's coverage instrumentation is clang's; the sanitizer build's flags.
FUZZ_CMAKE_ARGS ?= -DWKV_FUZZ=ON -DWKV_SANITIZE=address -DBUILD_TESTING=OFF \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ $(SANITIZER_CMAKE_ARGS)

.PHONY: all deps configure build test test-asan test-tsan fuzz demo bench install clean help

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

test-asan: deps
	$(call configure-in,build-asan,-DWKV_SANITIZE=address $(SANITIZER_CMAKE_ARGS) $(CMAKE_ARGS))
	$(CMAKE) --build build-asan -j $(JOBS)
	$(CTEST) --test-dir build-asan -L cpu $(CTEST_FLAGS)

test-tsan: deps
	$(call configure-in,build-tsan,-DWKV_SANITIZE=thread $(SANITIZER_CMAKE_ARGS) $(CMAKE_ARGS))
	$(CMAKE) --build build-tsan -j $(JOBS)
	$(CTEST) --test-dir build-tsan -L cpu $(CTEST_FLAGS)

# Each target runs on a scratch copy of its seeds (new inputs go to
# build-fuzz/corpus, never into the tree); a finding fails the target and
# leaves its input as crash-* / leak-* / timeout-* in build-fuzz/.
fuzz: deps
	$(call configure-in,build-fuzz,$(FUZZ_CMAKE_ARGS) $(CMAKE_ARGS))
	$(CMAKE) --build build-fuzz -j $(JOBS) $(addprefix --target fuzz_,$(FUZZ_TARGETS))
	@set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p build-fuzz/corpus/$$t; \
	  echo "fuzz_$$t: $(FUZZ_SECONDS) s"; \
	  build-fuzz/bin/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=20 -rss_limit_mb=4096 \
	    -print_final_stats=1 -artifact_prefix=build-fuzz/ build-fuzz/corpus/$$t tests/fuzz/corpus/$$t; \
	done

demo: build
	"$(BUILD)/bin/wavekv" demo

bench: build
	"$(BUILD)/bin/wavekv" bench

install: build
	$(CMAKE) --install "$(BUILD)" --prefix "$(PREFIX)"

clean:
	rm -rf "$(BUILD)" build-asan build-tsan build-fuzz

help:
	@sed -n '3,15p' Makefile
