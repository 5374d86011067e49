#!/usr/bin/env bash
# Install verl 0.9.1 + vLLM 0.24.0 + entropy-rft on one Ray node (run it on every node, same Python).
# verl[vllm] pins torch 2.11.0 (CUDA build), vllm 0.24.0 and transformers 5.9.0 (verl needs transformers<5.11).
# entropy-rft goes in with --no-deps: its own TRL dependency (trl 1.16) is for the TRL engine, not for verl,
# and verl's fsdp extra pins trl 0.27. The rest of what the verl integration imports is pinned by
# examples/verl/constraints-node.txt.
#
#   bash examples/verl/install_node.sh /path/to/entropy-rft-checkout
set -euo pipefail
SRC=${1:-.}
HERE=$(cd "$(dirname "$0")" && pwd)
python -m pip install -c "$HERE/constraints-node.txt" 'verl[vllm]==0.9.1'
python -m pip install -c "$HERE/constraints-node.txt" math-verify reasoning-gym champ-dataset gguf rich pyyaml \
    safetensors filelock scipy matplotlib
python -m pip install --no-deps -e "$SRC"
python -c "import verl, vllm, entropy_rft.integrations.verl as ev; print('verl', verl.__version__, 'vllm', vllm.__version__, \
'erft losses', len(ev.loss_names()))"
