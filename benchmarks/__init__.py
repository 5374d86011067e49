"""The project's benchmarks: a package, run from the checkout's root as modules (``python -m benchmarks.gpu.realm``,
``python -m benchmarks.lease.kit next``); its modules import each other as ``benchmarks.<folder>.<module>``, under
the layers of benchmarks/README.md ("Layers", kept by tests/test_benchmarks_layers.py).

The one bootstrap of every script: where entropy_rft is not installed (the lent GPU machine, whose image has no
install; ``make run-gpu`` under the image's python3), the checkout's ``src/`` is appended to ``sys.path`` here, so
an installed package still comes first.
"""

import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.append(_SRC)
