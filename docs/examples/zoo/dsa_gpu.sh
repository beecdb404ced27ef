#!/usr/bin/env bash
# GLM-5 and DeepSeek-V3.2 at their real widths on one H100 or H200 (issue 44), from the repository root, with the cp312
# wheels in .whl/ (megatron-core 0.19.2, transformers 5.3.0, tokenizers 0.22.2, ...) and in .whl523/ those of the
# environment "transformers-5.23.0" (transformers 5.23.0, tokenizers 0.23.1: DeepSeek-V3.2's HF class), OUT set to where
# the small reports go:
#
#   OUT=/tmp/out docs/examples/zoo/dsa_gpu.sh
#
# .whl523 from a machine with the package index: `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_17_x86_64 transformers==5.23.0 tokenizers==0.23.1 -d .whl523` (16 MB; carry it as .whl).
# Not run on a GPU yet (2026-12-06: no device machine came in six tries).
#
# The wheels go to /tmp/site, named by a .pth in the machine's interpreter (not PYTHONPATH, which would put
# transformers 5.3.0 ahead of the environment's 5.23.0); the environment is made from .whl523 without an index. Runs
# the `_full` cases of cases/glm_moe_dsa.toml and cases/deepseek_v32.toml: HF against itself, then the Megatron-vs-HF
# pairs (GLM-5: megatron-core 0.19.2 on the harness's local DSA spec; DeepSeek-V3.2: UNSUPPORTED, its megatron.toml has
# no [dsa] table; GLM-5's other GPU pairs: docs/model.md "GLM-5"). Prints each verdict
# line and whether it met the case's expectation; exits 1 if a run ends in ERROR.
set -uo pipefail
OUT=${OUT:-/tmp/dsa}
CASES=${CASES:-glm_moe_dsa_2layer_full deepseek_v32_2layer_full glm_moe_dsa_2layer_full_megatron \
deepseek_v32_2layer_full_megatron}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_cases.sh"
install_wheels || exit 1
[ -e .venv-hf523/.installed ] || PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl523 python3 -m harness.environments \
    transformers-5.23.0 || exit 1
python3 -W ignore -c "import torch, megatron.core as m, transformers as t
print('torch', torch.__version__, '| device', torch.cuda.get_device_name(), '| megatron-core', m.__version__,
      '| transformers', t.__version__, t.__file__)" || exit 1
.venv-hf523/bin/python -W ignore -c "import transformers as t; print('environment transformers-5.23.0:', t.__version__)"
TIMEOUT=900
run_cases
