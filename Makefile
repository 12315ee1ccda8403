# The two commands of the README, each doing its own set-up on a fresh machine:
#   make run    build and run `elasticep bench` on its default scenario (CPU backend without a GPU)
#   make test   build and run every test (CTest labels cpu, gpu, python, packaging)
SHELL := /bin/bash
BUILD ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
CMAKE = $(shell scripts/find-cmake.sh cmake)
CTEST = $(shell scripts/find-cmake.sh ctest)
CMAKE_ARGS ?=

.PHONY: all deps configure build run test clean

all: build

deps:
	@bash scripts/deps.sh

configure: deps
	@$(CMAKE) -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DELASTICEP_BUILD_PYTHON=ON $(CMAKE_ARGS) > $(BUILD).configure.log 2>&1 \
		|| { cat $(BUILD).configure.log; exit 1; }
	@grep -E "ElasticEP" $(BUILD).configure.log || true

build: configure
	@$(CMAKE) --build $(BUILD) -j $(JOBS)

run: build
	./$(BUILD)/tools/elasticep bench

test: build
	$(CTEST) --test-dir $(BUILD) --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD) $(BUILD).configure.log
