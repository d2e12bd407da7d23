# Two-command quick start: `make demo` and `make test`. Both set up .venv first.
# The venv sees system site-packages so an existing (CUDA) torch is reused;
# torch==2.13.0 (CPU wheel) is installed only when torch is not importable.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_OUT ?= runs/demo

.PHONY: setup demo test lint bench-capture clean

$(VENV)/.setup-done: pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-ci.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.setup-done

# The main job on the bundled default model: capture exact routing of every shipped prompt
# (teacher-forced decode), train our predictor one MoE layer ahead (d1) on the train prompts,
# and score it against every peer on the held-out test prompts.
demo: setup
	$(PY) -m tensorbend collect --model zoo:default --out $(DEMO_OUT)/trace --decode teacher \
		--max-new-tokens 16 --features ids weights gate_input layer_input --overwrite
	$(PY) -m tensorbend trace info $(DEMO_OUT)/trace
	$(PY) -m tensorbend train --trace $(DEMO_OUT)/trace --out $(DEMO_OUT)/ours_d1.safetensors --lookahead d1
	$(PY) -m tensorbend eval --trace $(DEMO_OUT)/trace --predictor $(DEMO_OUT)/ours_d1.safetensors \
		--baselines all --lookahead d1 --json $(DEMO_OUT)/eval.json --plots $(DEMO_OUT)/plots

test: setup
	$(PY) -m pytest

lint: setup
	$(PY) -m ruff check tensorbend tests bench
	$(PY) -m ruff format --check tensorbend tests bench

bench-capture: setup
	$(PY) bench/capture_overhead.py --json $(DEMO_OUT)/capture_overhead.json

clean:
	rm -rf $(VENV) runs
