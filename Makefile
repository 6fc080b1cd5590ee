# make demo   set up .venv and train configs/quickstart.yaml on 2 CPU processes
# make test   set up and run every test (and lint)
# make bench  the launcher against a hand-written torchrun loop (writes bench/results/)

PYTHON ?= python3.11
VENV := .venv
export PYTHON

.PHONY: demo test lint bench env clean docs

env: $(VENV)/.ready

$(VENV)/.ready: requirements/dev.txt pyproject.toml tools/mkenv.sh
	tools/mkenv.sh $(VENV) requirements/dev.txt
	touch $@

demo: env
	$(VENV)/bin/train --config configs/quickstart.yaml

lint: env
	$(VENV)/bin/python -m ruff check launcher recipes tests bench
	$(VENV)/bin/python -m ruff format --check launcher recipes tests bench

test: env lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests

bench: env
	$(VENV)/bin/python bench/compare.py --ours "$(VENV)/bin/train --config bench/gpt_bench.yaml --run-dir {run_dir}"
	$(VENV)/bin/python bench/checkpoint_blocking.py
	$(VENV)/bin/python bench/fsdp_memory.py

clean:
	rm -rf $(VENV) build *.egg-info

docs: env
	$(VENV)/bin/python -m launcher.spec_docs --write
