#!/usr/bin/env bash
# The GPU path in one prepared run (≤ 8 minutes on one GPU); see tools/gpu_check.py for what it checks.
#
#   bash tools/gpu_check.sh [--small] [extra gpu_check.py args]
#
# Needs torch with CUDA, transformers and numpy; nothing is downloaded (the model has random weights).
# Wheels of anything else (e.g. mpi4py + mpich for the launch check) can be put in .whl/: they are
# installed into /tmp/site first. Prints one line per check and a JSON object on the last line; exits
# non-zero when a check failed or no GPU is there, naming what failed and what could not be tested.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || echo "gpu_check: installing .whl/ failed; going on without it" >&2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 480 python3 tools/gpu_check.py "$@"
code=$?
[ "$code" -eq 124 ] && echo '{"ok": false, "error": "gpu_check.py ran past 480 s"}'
[ "$code" -ne 0 ] && echo "gpu_check: FAILED (exit $code)" >&2
exit "$code"
