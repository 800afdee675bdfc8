# The two commands of the README:
#   make demo   installs what is missing, builds, and prints the memory breakdown of GPT-2 small training
#   make test   installs what is missing, builds, and runs every test (unit, golden, CLI, PyTorch oracle)
MAKEFLAGS += --no-print-directory
BUILD ?= build
JOBS ?= $(shell nproc)
DEMO_ARGS ?= --model nanogpt-gpt2 --batch 12 --seq 1024 --precision bf16-amp --attention eager --gpu a100-80gb

.PHONY: setup configure build demo test bench clean

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

bench: build
	@./$(BUILD)/bench/trainmem_bench

clean:
	rm -rf $(BUILD)
