# make demo   set up .venv and train configs/quickstart.yaml on 2 CPU processes
# make test   set up and run every test (and lint)
# make bench  the launcher against hand-written torchrun loops, ddp, fsdp, HSDP and TP (writes bench/results/)
# make bench-gpu-smoke  bench/gpu_bench.py's rows, tiny, on CPU (before a GPU session runs it)
# make gpu-wheels       the wheels its GPU run carries, into bench/wheels/ (BENCHMARKS.md)

PYTHON ?= python3.11
VENV := .venv
# torch 2.9.0 + torch_xla 2.9.0 (7 GB, cached under ~/.cache/launcher/envs)
VENV_XLA := .venv-xla
# The smoke suite's other torch versions: 2.11 (the GPU machines'; a 4 GB CUDA build, cached
# like the others) and 2.14 (the newest).
SMOKE_TORCH := 211 214
export PYTHON

.PHONY: demo test test-dev test-dev-beside test-dev-third test-other-torch test-xla test-smoke lint bench env env-xla env-smoke clean docs

env: $(VENV)/.ready
env-xla: $(VENV_XLA)/.ready
env-smoke: $(SMOKE_TORCH:%=.venv-torch%/.ready)

$(VENV)/.ready: requirements/dev.txt pyproject.toml tools/mkenv.sh
	tools/mkenv.sh $(VENV) requirements/dev.txt
	touch $@

$(VENV_XLA)/.ready: requirements/xla.txt pyproject.toml tools/mkenv.sh
	tools/mkenv.sh $(VENV_XLA) requirements/xla.txt
	touch $@

.venv-torch%/.ready: requirements/torch%.txt pyproject.toml tools/mkenv.sh
	tools/mkenv.sh .venv-torch$* requirements/torch$*.txt
	touch $@

demo: env
	$(VENV)/bin/train --config configs/quickstart.yaml
	@echo
	@echo "To run train yourself, put it on your PATH:  source .venv/bin/activate"
	@echo "Then: train --help, train runs, train plot runs/quickstart/*"

lint: env
	$(VENV)/bin/python -m ruff check launcher recipes tests bench
	$(VENV)/bin/python -m ruff format --check launcher recipes tests bench

# Three suites run side by side on 2 cores: each spends some of its time waiting on processes
# it started (startup, rendezvous, signals, a tracker's timeout), and a third one keeps both
# cores busy through those waits; each one's output is shown whole when it ends.
# The slowest tests each suite names at its end: `make test DURATIONS=0` names them all.
DURATIONS ?= 8
# How each 2.13 suite and the XLA suite run pytest: quiet, no cache folder in the checkout.
PYTEST_FLAGS = -q -p no:cacheprovider --durations=$(DURATIONS)

test: lint
	$(MAKE) --no-print-directory -j3 --output-sync=target test-dev test-dev-beside test-other-torch

# make test while two busy loops hold both cores, as on a loaded CI machine: a test that waits
# a fixed time for a state, instead of for the state, fails here. The loops end with it,
# whatever the outcome (Ctrl-C too: loops started in the background ignore SIGINT).
.PHONY: test-loaded
test-loaded:
	@(while :; do :; done) & a=$$!; (while :; do :; done) & b=$$!; \
	trap 'kill $$a $$b 2>/dev/null' EXIT; trap 'exit 130' HUP INT TERM; \
	$(MAKE) --no-print-directory test

# Beside the suite on torch 2.13: the XLA tests and the smoke suite on torch 2.9 (the one
# torch_xla pins), then the smoke suite on 2.11 and 2.14, then DEV_THIRD.
test-other-torch:
	$(MAKE) --no-print-directory test-xla test-smoke test-dev-third

# The suite on torch 2.13 is split in three so that the three suites of make test end
# together (about 800 CPU-seconds each): DEV_BESIDE is a session of its own, DEV_THIRD runs
# after the other versions' suites, the rest is test-dev. The layouts compared with one ddp
# reference (tests/parallel/layouts.py) run in one session, to share it.
DEV_BESIDE := tests/parallel/test_dims.py tests/parallel/test_pipeline.py \
	tests/parallel/test_memory_estimate.py \
	tests/worker/test_compile.py \
	tests/replicas/test_fault_tolerance.py tests/replicas/test_fault_tolerance_exposure.py \
	tests/replicas/test_semi_sync.py \
	tests/launch/test_multinode.py \
	tests/checkpoint/test_object_store.py tests/checkpoint/test_storage_faults.py \
	tests/parallel/test_experts.py tests/runs/test_runs_view.py tests/launch/test_failures.py
DEV_THIRD := tests/worker/test_stragglers.py tests/parallel/test_pipeline_hf.py \
	tests/metrics/test_trackers.py

test-dev: env
	$(VENV)/bin/python -m pytest $(PYTEST_FLAGS) tests $(DEV_BESIDE:%=--ignore=%) $(DEV_THIRD:%=--ignore=%)

test-dev-beside: env
	$(VENV)/bin/python -m pytest $(PYTEST_FLAGS) $(DEV_BESIDE)

test-dev-third: env
	$(VENV)/bin/python -m pytest $(PYTEST_FLAGS) $(DEV_THIRD)

# On torch 2.9, the version torch_xla pins: the XLA tests (marked xla: tests/parallel/test_xla.py and
# others) run for real on XLA's CPU devices, and the smoke suite shows the rest of the
# launcher runs there too (the whole suite there would not fit in make test's 20 minutes).
# XLA_CPU_TEST_FLAGS: the tests' graphs compile with LLVM's cheap passes. Compiling is nearly all
# of an XLA test's time on CPU (a 12-step GPT run: 53.6 s of 55.6), and these flags cut it 3.5x;
# no test compares XLA's numbers with another setting of them (exact resumes compare two runs
# compiled alike; matches with plain torch allow float rounding). TPUs ignore them.
XLA_CPU_TEST_FLAGS := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true
test-xla: env-xla
	PJRT_DEVICE=CPU XLA_FLAGS="$(XLA_CPU_TEST_FLAGS)" LAUNCHER_REQUIRE_XLA=1 $(VENV_XLA)/bin/python -m pytest $(PYTEST_FLAGS) -m "(xla or smoke) and not launcher_only" tests

# One end-to-end run of each main path (tests marked smoke) on every other supported torch.
test-smoke: env-smoke
	@for v in $(SMOKE_TORCH); do \
		echo "smoke suite on $$(.venv-torch$$v/bin/python -c 'import torch; print("torch", torch.__version__)')"; \
		.venv-torch$$v/bin/python -m pytest -q -p no:cacheprovider -m smoke tests || exit 1; \
	done

bench: env
	$(VENV)/bin/python bench/compare.py --ours "$(VENV)/bin/train --config bench/gpt_bench.yaml --run-dir {run_dir}"
	$(VENV)/bin/python bench/checkpoint_blocking.py
	$(VENV)/bin/python bench/fsdp_memory.py
	$(VENV)/bin/python bench/log_flood.py
	$(VENV)/bin/python bench/eval_cost.py
	$(VENV)/bin/python bench/fsdp_overhead.py
	$(VENV)/bin/python bench/dims_overhead.py
	$(VENV)/bin/python bench/hf_pipeline.py
	$(VENV)/bin/python bench/hf_experts.py
	$(VENV)/bin/python bench/cli_startup.py
	$(VENV)/bin/python bench/worker_start.py
	$(VENV)/bin/python bench/failure_memory.py
	$(VENV)/bin/python bench/bounded_reads.py
	$(VENV)/bin/python bench/ema_cost.py
	$(VENV)/bin/python bench/straggler_cost.py
	$(VENV)/bin/python bench/runs_scale.py
	$(VENV)/bin/python bench/trackers_cost.py
	$(VENV)/bin/python bench/checksum_cost.py --store
	$(VENV)/bin/python bench/peer_state_transfer.py

# bench/gpu_bench.py (BENCHMARKS.md): every row tiny on CPU, to see it runs before a GPU session
# spends device minutes; and the wheels a lent GPU machine lacks, into bench/wheels/.
.PHONY: bench-gpu-smoke gpu-wheels
bench-gpu-smoke: env
	$(VENV)/bin/python bench/gpu_bench.py --smoke

gpu-wheels: env
	bench/gpu_wheels.sh

clean:
	rm -rf $(VENV) $(VENV_XLA) .venv-torch* build *.egg-info

docs: env
	$(VENV)/bin/python -m launcher.config.reference --write
