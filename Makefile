# Two-command quick start: `make demo` and `make test`. Both set up .venv first.
# The venv sees system site-packages so an existing (CUDA) torch is reused;
# torch==2.13.0 (CPU wheel) is installed only when torch is not importable.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_OUT ?= runs/demo

.PHONY: setup demo test lint bench bench-traces bench-accuracy bench-timing bench-headline bench-headline-deep bench-headline-deep-domain bench-headline-deep-x4 bench-headline-domain bench-evictor bench-serve bench-serve-group bench-serve-accelerate bench-headline-group clean

$(VENV)/.setup-done: pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-ci.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.setup-done

# The main job on the bundled default model (tensorbend/demo.py): capture routing, train ours
# (within and across tokens) and the seed's MLP, score them with every peer on held-out prompts,
# run offloaded generation against the best caches and the oracle, project onto Kimi-K2.5.
demo: setup
	$(PY) -m tensorbend demo --out $(DEMO_OUT)

test: setup
	$(PY) -m pytest

lint: setup
	$(PY) -m ruff check tensorbend tests bench tools
	$(PY) -m ruff format --check tensorbend tests bench tools

# Every published number, regenerated (docs/ and docs/bench/). The accuracy part is
# deterministic; the timing part must run alone on the machine (nothing else on the cores).
BENCH := runs/bench
# Held-out domains: predictors fitted on the other topics' prompts, tested on these topics'.
DOMAIN_TOPICS := multilingual,poetry,python,tables
# A trace is done when it opens and says complete (Trace.info, as `trace info` prints it): an
# interrupted collection leaves a manifest that does not, and `collect --resume` continues it,
# keeping every finished prompt.
trace_done = $(PY) -c "import sys; from tensorbend.trace import Trace; \
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
		for d in d2 d3; do test -f $(BENCH)/$$m/ours_$$d.safetensors || $(PY) -m tensorbend \
			train --quiet --trace $(BENCH)/$$m/trace --out $(BENCH)/$$m/ours_$$d.safetensors \
			--lookahead $$d; done; \
		test -f $(BENCH)/$$m/horizon_routing_hidden.safetensors || $(PY) -m tensorbend train \
			--quiet --trace $(BENCH)/$$m/trace --predictor horizon --inputs routing+hidden \
			--out $(BENCH)/$$m/horizon_routing_hidden.safetensors; \
		test -f $(BENCH)/$$m/horizon_routing.safetensors || $(PY) -m tensorbend train \
			--quiet --trace $(BENCH)/$$m/trace --predictor horizon --inputs routing \
			--out $(BENCH)/$$m/horizon_routing.safetensors; \
		test -f $(BENCH)/$$m/evictor.safetensors || $(PY) -m tensorbend train --quiet \
			--trace $(BENCH)/$$m/trace --predictor evictor --out $(BENCH)/$$m/evictor.safetensors; \
		test -f $(BENCH)/$$m/evictor_forecast.safetensors || $(PY) -m tensorbend train --quiet \
			--trace $(BENCH)/$$m/trace --predictor evictor \
			--horizon $(BENCH)/$$m/horizon_routing_hidden.safetensors \
			--out $(BENCH)/$$m/evictor_forecast.safetensors; \
	done

bench-accuracy: bench-traces
	for m in default qwen deep; do \
		$(PY) -m bench.foresight_eval --trace $(BENCH)/$$m/trace --out $(BENCH)/$$m \
			--json docs/foresight_$$m.json --doc docs/foresight_$$m.md > /dev/null; \
		$(PY) -m bench.evictor_eval --trace $(BENCH)/$$m/trace \
			$$([ $$m = deep ] && echo --fracs 0.25) \
			--foresight-json docs/foresight_$$m.json --rounds 2 --ablation-rounds 0 \
			--horizon $(BENCH)/$$m/horizon_routing_hidden.safetensors \
			--train-requests 60 --models runs/evictor/$$m --json docs/evictor_$$m.json \
			--doc docs/evictor_$$m.md > /dev/null; \
	done
	for m in default deep; do \
		test -f $(BENCH)/$${m}_domain/trace/manifest.json || $(PY) -m tensorbend trace resplit \
			$(BENCH)/$$m/trace --test-topics $(DOMAIN_TOPICS) --out $(BENCH)/$${m}_domain/trace; \
		$(PY) -m bench.foresight_eval --trace $(BENCH)/$${m}_domain/trace \
			--out $(BENCH)/$${m}_domain --inputs routing+hidden --fracs 0.25 \
			--json docs/foresight_$${m}_domain.json --doc docs/foresight_$${m}_domain.md > /dev/null; \
		$(PY) -m bench.evictor_eval --trace $(BENCH)/$${m}_domain/trace \
			--foresight-json docs/foresight_$${m}_domain.json --fracs 0.25 --rounds 2 \
			--ablation-rounds 0 --train-requests 60 --no-ablations \
			--horizon $(BENCH)/$${m}_domain/horizon_routing_hidden.safetensors \
			--models runs/evictor/$${m}_domain --json docs/evictor_$${m}_domain.json \
			--doc docs/evictor_$${m}_domain.md > /dev/null; \
	done
	# zoo:dsv3-deep's routing as an imported trace has it (routing only: no hidden states)
	test -f $(BENCH)/deep_imported/trace/manifest.json || ( \
		$(PY) -m tensorbend trace export $(BENCH)/deep/trace \
			--out $(BENCH)/deep_imported/routing.csv && \
		$(PY) -m tensorbend trace import --from csv $(BENCH)/deep_imported/routing.csv \
			--out $(BENCH)/deep_imported/trace --num-experts 64 --quiet \
			--model "zoo:dsv3-deep, imported (routing only)" )
	$(PY) -m bench.foresight_eval --trace $(BENCH)/deep_imported/trace \
		--out $(BENCH)/deep_imported --inputs routing --fracs 0.25 \
		--json docs/foresight_deep_imported.json --doc docs/foresight_deep_imported.md > /dev/null
	$(PY) -m bench.evictor_eval --trace $(BENCH)/deep_imported/trace --fracs 0.25 \
		--foresight-json docs/foresight_deep_imported.json --rounds 2 --ablation-rounds 0 \
		--train-requests 60 --no-ablations --models runs/evictor/deep_imported \
		--json docs/evictor_deep_imported.json --doc docs/evictor_deep_imported.md > /dev/null
	$(PY) -m bench.projections --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--json docs/projections.json --doc docs/projections.md > /dev/null
	$(PY) -m bench.zoo_card $(BENCH)/default/trace $(BENCH)/qwen/trace $(BENCH)/deep/trace \
		--json docs/zoo_card.json --doc docs/zoo_card.md > /dev/null
	$(PY) -m bench.train_memory --trace $(BENCH)/default/trace \
		--json docs/bench/train_memory.json --doc docs/bench/train_memory.md > /dev/null

bench-timing: bench-traces
	for m in default qwen; do \
		model=$$([ $$m = default ] && echo zoo:default || echo zoo:qwen3moe-tiny); \
		$(PY) -m bench.offload_sweep --model $$model --trace $(BENCH)/$$m/trace \
			--predictor $(BENCH)/$$m/ours_d1.safetensors \
			--horizon $(BENCH)/$$m/horizon_routing_hidden.safetensors \
			--baselines spec_gate,transition,random --max-prompts 6 --max-new-tokens 48 \
			--out docs/bench/offload_$$m --doc docs/offload_$$m.md > /dev/null; \
	done
	$(PY) -m bench.offload_sweep --model zoo:default --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--baselines spec_gate,transition,random --max-prompts 8 --max-new-tokens 48 --batch 4 \
		--fracs 0.25,0.5 --link-speedups 1 --out docs/bench/offload_default_b4 \
		--doc docs/offload_default_b4.md > /dev/null
	$(PY) -m bench.simulate_validate --model zoo:default --max-prompts 5 --max-new-tokens 32 \
		--predictor $(BENCH)/default/ours_d1.safetensors --baseline transition \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--train-trace $(BENCH)/default/trace --json docs/simulate_validation.json \
		--doc docs/simulate_validation.md > /dev/null
	$(PY) -m bench.predictor_cost --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors --repeats 7 \
		--predictor-group $(BENCH)/default/ours_d1.safetensors $(BENCH)/default/ours_d2.safetensors \
		--predictor-group $(BENCH)/default/ours_d1.safetensors $(BENCH)/default/ours_d2.safetensors \
			$(BENCH)/default/ours_d3.safetensors \
		--json docs/bench/predictor_cost.json > /dev/null
	$(PY) -m bench.cold_call --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--json docs/bench/cold_call.json > /dev/null
	$(PY) -m bench.replay_speed --json docs/bench/replay_speed.json \
		--doc docs/bench/replay_speed.md > /dev/null
	$(PY) -m bench.capture_overhead --json docs/bench/capture_overhead.json > /dev/null
	$(PY) -m bench.trace_io --json docs/bench/trace_io.json > /dev/null

# The headline end-to-end comparison: 25% cache, every no-prediction cache and ours (fixed
# configurations), 3 interleaved repeats, both links, and 4 sequences in lockstep at the x1
# link (run alone on the machine).
bench-headline: bench-traces
	for m in default qwen; do \
		model=$$([ $$m = default ] && echo zoo:default || echo zoo:qwen3moe-tiny); \
		$(PY) -m bench.offload_sweep --model $$model --trace $(BENCH)/$$m/trace \
			--predictor $(BENCH)/$$m/ours_d1.safetensors \
			--horizon $(BENCH)/$$m/horizon_routing_hidden.safetensors --baselines "" \
			--fracs 0.25 --foresights all --repeats 3 --max-prompts 6 --max-new-tokens 48 \
			--out docs/bench/headline_$$m --doc docs/headline_$$m.md > /dev/null; \
	done
	$(PY) -m bench.offload_sweep --model zoo:default --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors --baselines "" \
		--fracs 0.25 --foresights all --repeats 3 --max-prompts 4 --max-new-tokens 48 --batch 4 \
		--link-speedups 1 --out docs/bench/headline_default_b4 \
		--doc docs/headline_default_b4.md > /dev/null

# Predictor groups (d1 + d2 from every other router, d1 + d2 + d3 from every third) beside d1
# alone, at 25% cache, both links, against the two best no-prediction caches of bench-headline
# (docs/headline_group.md).
bench-headline-group: bench-traces
	$(PY) -m bench.offload_sweep --model zoo:default --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors \
		--predictor-group $(BENCH)/default/ours_d1.safetensors $(BENCH)/default/ours_d2.safetensors \
		--predictor-group $(BENCH)/default/ours_d1.safetensors $(BENCH)/default/ours_d2.safetensors \
			$(BENCH)/default/ours_d3.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors --baselines "" \
		--caches lru,lfru --pools per_layer --admissions frequency --fracs 0.25 --foresights all \
		--repeats 3 --max-prompts 6 --max-new-tokens 48 --link-speedups 1,4 \
		--out docs/bench/headline_group --doc docs/headline_group.md > /dev/null

# zoo:dsv3-deep (routing like a real MoE's): the same comparison at the x1 link and three
# cache sizes, with both learned evictions in the same run (4 prompts x 24 tokens: the model
# decodes ~4x slower); then batch 4.
bench-headline-deep: bench-traces
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep/trace \
		--predictor $(BENCH)/deep/ours_d1.safetensors \
		--horizon $(BENCH)/deep/horizon_routing_hidden.safetensors \
		--evictor $(BENCH)/deep/evictor.safetensors \
		--evictor-forecast $(BENCH)/deep/evictor_forecast.safetensors --baselines "" \
		--fracs 0.125,0.25,0.5 --foresights all --repeats 3 --max-prompts 4 \
		--max-new-tokens 24 --link-speedups 1 --out docs/bench/headline_deep \
		--doc docs/headline_deep.md > /dev/null
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep/trace \
		--predictor $(BENCH)/deep/ours_d1.safetensors \
		--horizon $(BENCH)/deep/horizon_routing_hidden.safetensors --baselines "" \
		--fracs 0.25 --foresights all --repeats 3 --max-prompts 4 --max-new-tokens 24 \
		--batch 4 --link-speedups 1 --out docs/bench/headline_deep_b4 \
		--doc docs/headline_deep_b4.md > /dev/null

# zoo:dsv3-deep at 25% cache on the 4x faster link.
bench-headline-deep-x4: bench-traces
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep/trace \
		--predictor $(BENCH)/deep/ours_d1.safetensors \
		--horizon $(BENCH)/deep/horizon_routing_hidden.safetensors --baselines "" \
		--fracs 0.25 --foresights all --repeats 3 --max-prompts 4 --max-new-tokens 24 \
		--link-speedups 4 --out docs/bench/headline_deep_x4 --doc docs/headline_deep_x4.md > /dev/null

# zoo:dsv3-deep on held-out topics (runs/bench/deep_domain: its horizon from bench-accuracy).
bench-headline-deep-domain: bench-accuracy
	test -f $(BENCH)/deep_domain/ours_d1.safetensors || $(PY) -m tensorbend train --quiet \
		--trace $(BENCH)/deep_domain/trace --out $(BENCH)/deep_domain/ours_d1.safetensors \
		--lookahead d1
	$(PY) -m bench.offload_sweep --model zoo:dsv3-deep --trace $(BENCH)/deep_domain/trace \
		--predictor $(BENCH)/deep_domain/ours_d1.safetensors \
		--horizon $(BENCH)/deep_domain/horizon_routing_hidden.safetensors --baselines "" \
		--fracs 0.25 --foresights all --repeats 3 --max-prompts 4 --max-new-tokens 24 \
		--link-speedups 1 --split all --topics $(DOMAIN_TOPICS) \
		--out docs/bench/headline_deep_domain --doc docs/headline_deep_domain.md > /dev/null

# Held-out domains end to end: zoo:default's predictors fitted on the other topics
# (runs/bench/default_domain, `trace resplit`), run on prompts of DOMAIN_TOPICS only.
bench-headline-domain: bench-accuracy
	test -f $(BENCH)/default_domain/ours_d1.safetensors || $(PY) -m tensorbend train --quiet \
		--trace $(BENCH)/default_domain/trace --out $(BENCH)/default_domain/ours_d1.safetensors \
		--lookahead d1
	$(PY) -m bench.offload_sweep --model zoo:default --trace $(BENCH)/default_domain/trace \
		--predictor $(BENCH)/default_domain/ours_d1.safetensors \
		--horizon $(BENCH)/default_domain/horizon_routing_hidden.safetensors --baselines "" \
		--fracs 0.25 --foresights all --repeats 3 --max-prompts 6 --max-new-tokens 48 \
		--link-speedups 1 --split all --topics $(DOMAIN_TOPICS) \
		--out docs/bench/headline_default_domain --doc docs/headline_default_domain.md > /dev/null

# The learned eviction end to end beside every no-prediction cache and the horizon, at the x1
# link (run alone; about 14 min here).
bench-evictor: bench-traces
	$(PY) -m bench.offload_sweep --model zoo:default --trace $(BENCH)/default/trace \
		--predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--evictor $(BENCH)/default/evictor.safetensors \
		--evictor-forecast $(BENCH)/default/evictor_forecast.safetensors \
		--baselines "" --fracs 0.25 --link-speedups 1 \
		--foresights all --repeats 3 --max-prompts 6 --max-new-tokens 48 \
		--out docs/bench/evictor_run_default --doc docs/evictor_run_default.md > /dev/null

# A 3.5 GB checkpoint served under a 1 GB budget (python -m bench.serve_memory; run alone).
bench-serve: bench-traces
	$(PY) -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 5 --prompts 3 \
		--max-new-tokens 48 --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--json docs/bench/serve_memory.json --doc docs/serve_memory.md > /dev/null

# The same serving, narrowed: the group d1+d2+d3 beside d1 alone, at jit=0 and with numba.
bench-serve-group: bench-traces
	$(PY) -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 3 --prompts 3 \
		--max-new-tokens 48 --predictor $(BENCH)/default/ours_d1.safetensors \
		--horizon $(BENCH)/default/horizon_routing_hidden.safetensors \
		--predictor-group $(BENCH)/default/ours_d1.safetensors $(BENCH)/default/ours_d2.safetensors \
			$(BENCH)/default/ours_d3.safetensors \
		--only 'lfru/adm=frequency$$|lru/per_layer$$|horizon\(evict only\)\+d1/per_layer/adm=predicted/jit=0$$|horizon\(evict only\)\+d1\+d2\+d3/per_layer/adm=predicted(/jit=0)?$$' \
		--json docs/bench/serve_memory_group.json --doc docs/serve_memory_group.md > /dev/null

# tensorbend beside transformers + accelerate offloading (the baseline without tensorbend), every
# run in a memory cgroup of import baseline + budget (needs root; run alone, ~30 min).
bench-serve-accelerate: setup
	$(PY) -m bench.serve_memory --factor 184 --max-memory 1GB --repeats 3 --prompts 3 \
		--max-new-tokens 48 --accelerate --memory-cap \
		--only 'lru$$|lfru/adm=frequency$$|lru/per_layer$$|accelerate' \
		--json docs/bench/serve_accelerate.json --doc docs/serve_accelerate.md > /dev/null

clean:
	rm -rf $(VENV) runs
