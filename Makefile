# `make demo` and `make test` work on a fresh machine with only python3 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One stamp per install set, so that `make demo` and `make test` share one .venv in either
# order: the demo's set is small, the dev set (lint, tests, benchmarks) holds every backend.
STAMP := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-slow test-all lint typecheck pytest bench bench-scale bench-memory models clean

$(VENV)/pyvenv.cfg:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The core and matplotlib (error_curve.png): what the demo runs, nothing more. No torch: its
# CPU build alone takes 870 MB, and PyPI's Linux build brings gigabytes of CUDA libraries;
# without it --threshold auto's float64 values come from onnx.reference, and the demo's
# verdicts and thresholds are the same (the [torch] extra is faster on large models).
$(DEMO_STAMP): pyproject.toml constraints-dev.txt | $(VENV)/pyvenv.cfg
	$(BIN)/python -m pip install --quiet -c constraints-dev.txt -e '.[plots]'
	touch $(DEMO_STAMP)

# The dev set holds the demo's, so it stamps both.
$(STAMP): pyproject.toml constraints-dev.txt | $(VENV)/pyvenv.cfg
	$(BIN)/python -m pip install --quiet -c constraints-dev.txt -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

# A clearly labelled SIMULATED faulty runtime (exec: protocol) with a 5% kernel error planted
# at one Conv: the demo shows the tool naming that node on any machine.
demo: $(DEMO_STAMP)
	@$(BIN)/bisect examples/models/yolo_like.onnx --ref cpu \
	  --target "exec:{python} examples/faulty_runtime.py {model} {inputs} {outputs} --fault /down1/conv/Conv=0.05" \
	  --out demo-report; rc=$$?; \
	  if [ $$rc -ne 1 ]; then echo "demo: expected exit 1 (divergence found), got $$rc"; exit 1; fi
	@echo "Exit 1 = divergence found. Reports in demo-report/ (report.html, report.md, report.json, nodes.csv, inputs.npz)"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# pytest exits 5 when it collects nothing; that is not a failure of the code under test.
# One worker per core, a test file per worker (files share models and directories).
# Two lanes: `make test` runs every test but the slow ones (each 8 s or more on 2 cores: marked
# @pytest.mark.slow, listed in tests/slow_tests.txt, or a doc example in test_docs.py's
# SLOW_GROUPS), `make test-slow` those; CI runs both. On 2 quiet cores the pytest phase of
# `make test` takes about 7 min (1,493 tests), `make test-slow` about 8 min (100 tests: the
# process tree's memory, Ray clusters, torch.compile/inductor, models over 2 GB, dataset jobs,
# a hang, Ctrl-C during the bundle check, ONNX's node tests on torch, long reductions).
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadfile
NO_TESTS_OK = rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc
test: lint
	$(PYTEST) -m "not slow"; $(NO_TESTS_OK)

test-slow: $(STAMP)
	$(PYTEST) -m slow; $(NO_TESTS_OK)

# Both lanes in one pytest call.
test-all: lint
	$(PYTEST); $(NO_TESTS_OK)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_yolo.py

# Diagnosis time against the node count (1k to 20k nodes), in bench-scale/.
bench-scale: $(STAMP)
	$(BIN)/python benchmarks/bench_scale.py

# Peak memory of the process tree under --max-memory (conv nets with huge intermediates), in
# bench-memory/. The big net takes about 6 minutes a row.
bench-memory: $(STAMP)
	$(BIN)/python benchmarks/bench_memory.py --nets small --budgets 80MB,256MB,1GB
	$(BIN)/python benchmarks/bench_memory.py --nets big --budgets 1088MB,4GB
	$(BIN)/python benchmarks/bench_memory.py --nets big --budgets 1GB --threshold 1e-3

models: $(STAMP)
	$(BIN)/python examples/build_models.py

clean:
	rm -rf $(VENV) demo-report bench-out bench-scale bench-memory
