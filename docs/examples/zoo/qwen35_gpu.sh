#!/usr/bin/env bash
# Qwen3.5-MoE on one H100 or H200 (issue 44), from the repository root, with the wheels in .whl/ (megatron-core
# 0.19.2 cp312, transformers 5.3.0, tokenizers 0.22.2, flash-linear-attention 0.6.0, einops) and OUT set to where the
# small reports go:
#
#   OUT=/tmp/out docs/examples/zoo/qwen35_gpu.sh
#
# Runs the GPU cases of cases/qwen3_5_moe.toml and cases/qwen3_5_moe_train.toml: HF against itself at Qwen3.5-35B-A3B's
# widths (model level, then 3 training steps), transformers taking fla's Triton kernels; then the Megatron-vs-HF pairs,
# whose HF side here sees fla too (qwen35_megatron_gpu.sh keeps fla on the Megatron side only). Prints, per case, the
# verdict line and whether it met the case's expectation; exits 1 if fla does not import or a run ends in ERROR.
set -uo pipefail
OUT=${OUT:-/tmp/qwen35}
CASES=${CASES:-qwen3_5_moe_2layer_full qwen3_5_moe_2layer_train_full qwen3_5_moe_2layer_full_megatron \
qwen3_5_moe_2layer_train_full_megatron}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_cases.sh"
install_wheels || exit 1
python3 -W ignore -c "import torch, fla, megatron.core as m, transformers as t
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q
print('torch', torch.__version__, '| device', torch.cuda.get_device_name(), '| megatron-core', m.__version__,
      '| transformers', t.__version__, '| fla', fla.__version__, '| HF fast path', q.is_fast_path_available,
      '| HF delta rule from', (q.chunk_gated_delta_rule or q.torch_chunk_gated_delta_rule).__module__)" \
    || { echo "flash-linear-attention (fla) does not import: nothing run"; exit 1; }
TIMEOUT=1200
run_cases
