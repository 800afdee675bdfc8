# The two commands of the README:
#   make demo   installs what is missing, builds, and prints the memory breakdown of GPT-2 small training
#   make test   installs what is missing, builds, and runs every test (unit, golden, CLI, Python module, PyTorch
#               oracle, the web page in headless Chromium)
#   make install  installs the trainmem executable (PREFIX/bin) and the Python module trainmem (the system
#                 python3's site directory, e.g. /usr/local/lib/python3.11/dist-packages); PREFIX ?= /usr/local.
#                 Without installing: PYTHONPATH=build/python python3 -c "import trainmem"
#   make web    builds the web page (the library in WebAssembly, emscripten) in build/web; open
#               build/web/index.html, or run make serve (trainmem serve) and open http://127.0.0.1:8000/
# Robustness (each in a build folder of its own; .ci/run runs all three after make test):
#   make sanitize  builds with AddressSanitizer and UndefinedBehaviorSanitizer (g++) in build-asan and runs the
#                  unit and CLI tests there (SANITIZE_LABELS)
#   make fuzz      builds the libFuzzer harnesses of fuzz/ (clang) in build-fuzz, replays the hostile and found
#                  inputs through them, then fuzzes each for FUZZ_SECONDS seconds (fuzz/run.sh)
#   make hostile   runs tests/hostile/cases.txt through the release trainmem executable
MAKEFLAGS += --no-print-directory
BUILD ?= build
JOBS ?= $(shell nproc)
PREFIX ?= /usr/local
PORT ?= 8000
DEMO_ARGS ?= --model nanogpt-gpt2 --batch 12 --seq 1024 --precision bf16-amp --attention eager --gpu a100-80gb

ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
SANITIZE_LABELS ?= unit|cli
SANITIZE_FLAGS ?= -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
FUZZ_FLAGS ?= -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer

.PHONY: setup configure build demo test install bench clean sanitize fuzz fuzz-build hostile web serve

setup:
	@bash scripts/setup.sh

configure: setup
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	@./$(BUILD)/trainmem estimate $(DEMO_ARGS)

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

install: build
	@cmake --install $(BUILD) --prefix $(PREFIX)

web: configure
	@cmake --build $(BUILD) --target web -j $(JOBS)

serve: web
	@cmake --build $(BUILD) --target trainmem -j $(JOBS)
	@./$(BUILD)/trainmem serve --port $(PORT)

bench: build
	@./$(BUILD)/bench/trainmem_bench

# -O1 -g: line numbers in the sanitizers' reports, and a build that stays quick to compile. Both builds leave the
# Python module out (-DTRAINMEM_PYTHON=OFF): an instrumented extension needs the sanitizer runtime preloaded into
# python3; the module's tests run in the release build.
sanitize: setup
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=g++ \
	  -DCMAKE_CXX_FLAGS="$(SANITIZE_FLAGS) -O1" -DTRAINMEM_BUILD_BENCH=OFF -DTRAINMEM_PYTHON=OFF \
	  -DTRAINMEM_BUILD_WEB=OFF >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	@cd $(ASAN_BUILD) && ASAN_OPTIONS=halt_on_error=1:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  ctest -L '$(SANITIZE_LABELS)' --output-on-failure -j $(JOBS)

fuzz-build: setup
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
	  -DCMAKE_CXX_FLAGS="$(FUZZ_FLAGS)" -DTRAINMEM_FUZZ=ON -DTRAINMEM_BUILD_TESTS=OFF -DTRAINMEM_BUILD_BENCH=OFF \
	  -DTRAINMEM_BUILD_CLI=OFF -DTRAINMEM_PYTHON=OFF -DTRAINMEM_BUILD_WEB=OFF >/dev/null
	@cmake --build $(FUZZ_BUILD) -j $(JOBS)

fuzz: fuzz-build
	@FUZZ_SECONDS=$(FUZZ_SECONDS) bash fuzz/run.sh $(FUZZ_BUILD)

hostile: build
	@python3 tests/hostile/run_hostile.py --trainmem $(BUILD)/trainmem --work $(BUILD)/tests/hostile/work

clean:
	rm -rf $(BUILD)
