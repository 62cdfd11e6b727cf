# make smoke: train the toy model end to end and check it; make test: the test suite. Both install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch requirement; CI passes torch==2.13.0 (this machine's CPU build). Default (auto): torch's CPU build without
# an NVIDIA GPU, its default (CUDA) build with one; scripts/pick_torch.py says which it chose and why.
TORCH ?= auto
# Optional extras installed with the project: dev tools, TensorBoard, the export targets, matplotlib, the server,
# py3langid (data.clean.langid), eflomal (data.terminology).
EXTRAS ?= dev,tensorboard,export,plot,serve,langid,align
PYTEST_ARGS ?=

.PHONY: install test test-fast smoke lint bench bench-serve bench-data quality faults gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $$($(BIN)/python scripts/pick_torch.py "$(TORCH)")
	$(BIN)/pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

test: install
	$(BIN)/pytest -q --durations=10 $(PYTEST_ARGS)

# The unit tier, under a minute: no model training, no shared corpora, no subprocesses (tests marked model or system;
# tests/conftest.py refuses a unit test that trains).
test-fast: install
	$(BIN)/pytest -q -m "not model and not system" --durations=5 $(PYTEST_ARGS)

# The toy model end to end: train (~1 min on 2 cores), score the test split, translate one sentence; fails loudly if
# test BLEU is under 80 (a broken mask, shift or search lands far below) or the translation is not the expected one.
# Its run is named make-smoke (config.yaml says so): a rerun replaces only a run of that name, never a folder of the
# user's; SMOKE_DIR=... puts it elsewhere.
SMOKE_DIR ?= runs/smoke
smoke: install
	@if [ -e "$(SMOKE_DIR)" ]; then \
	  grep -qx 'name: make-smoke' "$(SMOKE_DIR)/config.yaml" 2>/dev/null || { echo "smoke: $(SMOKE_DIR) holds \
	something make smoke did not make; move it away, or run make smoke SMOKE_DIR=another/folder"; exit 2; }; \
	  rm -rf "$(SMOKE_DIR)"; fi
	$(BIN)/mtcli train --config toy.yaml --set name=make-smoke --run-dir "$(SMOKE_DIR)"
	$(BIN)/mtcli eval --run "$(SMOKE_DIR)" --json > "$(SMOKE_DIR)/test.json"
	@$(BIN)/python -c "import json, sys; r = json.load(open('$(SMOKE_DIR)/test.json')); \
	print(f\"smoke: toy test BLEU {r['bleu']:.2f} chrF {r['chrf']:.2f} ({r['signature']})\"); \
	sys.exit(0 if r['bleu'] >= 80 else 'smoke: FAILED: toy test BLEU under 80')"
	@out=$$($(BIN)/mtcli translate --run "$(SMOKE_DIR)" "I love apples"); echo "smoke: I love apples -> $$out"; \
	test "$$out" = "我喜欢苹果" || { echo "smoke: FAILED: expected 我喜欢苹果"; exit 1; }

lint: install
	$(BIN)/ruff check mtcli tests benchmarks docs scripts
	$(BIN)/ruff format --check mtcli tests benchmarks docs scripts

bench: install
	$(BIN)/python benchmarks/bench.py $(BENCH_ARGS)

# Test BLEU after 800 updates of the benchmark spec (seeds 1 2, fp32) beside HF Marian's from ../shared/peers in the
# same run: the guard against quality regressions at the peers' budget (~35 min for mtcli, ~25 for HF Marian).
quality: install
	$(BIN)/python benchmarks/quality.py $(QUALITY_ARGS)

# mtcli serve under 1, 8 and 64 concurrent clients on localhost (Multi30k test sentences): sentences/s and p50/p95/p99
# latency, beside offline `mtcli translate --input` on the same sentences. BENCH_SERVE_ARGS=--run DIR picks the model.
BENCH_SERVE_ARGS ?=
bench-serve: install
	$(BIN)/python benchmarks/bench_serve.py $(BENCH_SERVE_ARGS)

# mtcli data prepare on seeded synthetic corpora (4M and 16M pairs, made by the script) and training start-up on the
# larger cache: wall time, pairs/s per phase, peak RSS of the process tree. BENCH_DATA_ARGS="--pairs 250000": shorter.
BENCH_DATA_ARGS ?=
bench-data: install
	$(BIN)/python benchmarks/bench_data.py $(BENCH_DATA_ARGS)

# The fault matrix: SIGKILLs (at least 20) with exact resume, full disk, NaN, torchrun restarts, a shared run
# directory, bad input, a 100 MB stdin; prints its counts. FAULTS_ARGS=--kills N sets the number of kills.
FAULTS_ARGS ?=
faults: install
	$(BIN)/python tests/faults.py $(FAULTS_ARGS)

# What a session lent a GPU runs first (benchmarks/gpu_check.py): the device and precision, SDPA kernels, host reads
# per update and per search step, fused loss in bf16/fp16, an fp16 step, graph breaks, the toy smoke on the device,
# Transformer-base tokens/s and MFU; each step with its own time limit; under 10 minutes. Needs no install and no
# network: mtcli is read from this checkout. On a CPU it runs what a CPU can and says what it skipped.
gpu-check:
	bash benchmarks/gpu.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs data/cache .pytest_cache .ruff_cache benchmarks/cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
