# make demo   set up .venv and train configs/quickstart.yaml on 2 CPU processes
# make test   set up and run every test (and lint)
# make bench  the launcher against a hand-written torchrun loop (writes bench/results/)

PYTHON ?= python3.11
VENV := .venv
# torch 2.9.0 + torch_xla 2.9.0 (7 GB, cached under ~/.cache/launcher/envs)
VENV_XLA := .venv-xla
export PYTHON

.PHONY: demo test test-dev test-xla lint bench env env-xla clean docs

env: $(VENV)/.ready
env-xla: $(VENV_XLA)/.ready

$(VENV)/.ready: requirements/dev.txt pyproject.toml tools/mkenv.sh
	tools/mkenv.sh $(VENV) requirements/dev.txt
	touch $@

$(VENV_XLA)/.ready: requirements/xla.txt pyproject.toml tools/mkenv.sh
	tools/mkenv.sh $(VENV_XLA) requirements/xla.txt
	touch $@

demo: env
	$(VENV)/bin/train --config configs/quickstart.yaml

lint: env
	$(VENV)/bin/python -m ruff check launcher recipes tests bench
	$(VENV)/bin/python -m ruff format --check launcher recipes tests bench

# The two suites run side by side: each spends much of its time waiting on processes it
# started (startup, rendezvous, signals), and together they keep 2 cores busy; each one's
# output is shown whole when it ends.
test: lint
	$(MAKE) --no-print-directory -j2 --output-sync=target test-dev test-xla

test-dev: env
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=8 tests

# The same suite on torch 2.9, the version torch_xla pins: the launcher must run there too,
# and the XLA tests (tests/test_xla.py) run for real on XLA's CPU devices. Tests marked
# launcher_only (bad input refused before torch matters, the log stream, the package's
# shape) run in .venv only.
test-xla: env-xla
	PJRT_DEVICE=CPU LAUNCHER_REQUIRE_XLA=1 $(VENV_XLA)/bin/python -m pytest -q -p no:cacheprovider --durations=8 -m "not launcher_only" tests

bench: env
	$(VENV)/bin/python bench/compare.py --ours "$(VENV)/bin/train --config bench/gpt_bench.yaml --run-dir {run_dir}"
	$(VENV)/bin/python bench/checkpoint_blocking.py
	$(VENV)/bin/python bench/fsdp_memory.py
	$(VENV)/bin/python bench/log_flood.py
	$(VENV)/bin/python bench/eval_cost.py

clean:
	rm -rf $(VENV) $(VENV_XLA) build *.egg-info

docs: env
	$(VENV)/bin/python -m launcher.spec_docs --write
