# Thin wrapper over CMake. `make test` and `make demo` do all the set-up.
JOBS    ?= $(shell nproc 2>/dev/null || echo 2)
BUILD   ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
PREFIX  ?= /usr/local
FUZZ_SECONDS ?= 60
CTEST_ARGS ?=

.PHONY: all deps build test demo bench asan-test fuzz format format-check install clean

all: build

deps:
	@bash scripts/deps.sh

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)
	@echo "built in $(BUILD)/. Compile against it: cc app.c \$$(PKG_CONFIG_PATH=$(BUILD) pkg-config --cflags --libs apiary)"

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

demo: build
	$(BUILD)/apiary demo

bench: build
	$(BUILD)/apiary bench all --json

asan-test: deps
	CC=clang cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug \
	  -DAPIARY_ASAN=ON -DAPIARY_UBSAN=ON -DCMAKE_C_FLAGS="-O1"
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 APIARY_SANITIZED=1 \
	  ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

fuzz: deps
	CC=clang cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DAPIARY_FUZZ=ON \
	  -DAPIARY_TESTS=OFF -DCMAKE_C_FLAGS="-O1 -fsanitize=fuzzer-no-link,address,undefined"
	cmake --build $(FUZZ_BUILD) -j $(JOBS)
	bash scripts/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

format-check:
	clang-format --dry-run --Werror $$(git ls-files '*.c' '*.h')

install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
