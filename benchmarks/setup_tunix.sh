#!/usr/bin/env bash
# Tunix (the JAX reference peer) in its own virtual environment, so it never constrains ours.
# Usage: bash benchmarks/setup_tunix.sh   ->   benchmarks/.venv-tunix/bin/python
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$here/.venv-tunix"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import tunix" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "google-tunix==0.1.7" "jax[cpu]"
fi
"$venv/bin/python" -c "import tunix, jax, flax; print('tunix ready: jax', jax.__version__, 'flax', flax.__version__)"
