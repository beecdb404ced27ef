#!/usr/bin/env bash
# Batch invariance of each registry family's 2-layer model (docs/batch-invariance.md, "The model level"): the case's
# 16-token sequence alone against the same sequence first in a batch with M = 1, 2, 4, ..., 64 other sequences whose
# loss weight is zero (`compare CASE --versus batch=1..64 --runner R`), per stack: every module output, the logits,
# the loss and every parameter gradient. table.md, table.json and log.txt come from gpu.sh (beside this file);
# model-table.md (model_table.py) splits each cell into the forward's and the gradients' M.
#
#   OUT=/some/folder docs/examples/batch/gpu_model.sh                          # on a GPU: HF and Megatron-Core
#   DEVICE=cpu OUT=/some/folder docs/examples/batch/gpu_model.sh               # the CPU table in the docs
#
# Environment (all optional; the others as gpu.sh takes them: PYTHON, JOBS, OUT, REPORTS):
#   RUNNERS  the stacks                                                              [hf_model megatron_model]
#   BATCH    the M of --versus batch                                                                  [1..64]
#   CASES    the cases, NAME@TOKENS                                  [each family's bf16 2-layer model, 16 tokens]
# Disk: REPORTS keeps every runner's outputs (5.2 GB for the bf16 default on a CPU): delete it once read.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export RUNNERS=${RUNNERS:-hf_model megatron_model}
export CASES=${CASES:-kimi_k2_2layer@16 glm4_moe_2layer@16 glm_moe_dsa_2layer@16 minimax_m2_2layer@16 \
qwen2_moe_2layer@16 qwen3_moe_2layer@16}
export REPORTS=${REPORTS:-$(cd "$HERE/../../.." && pwd)/reports/batch-model-${DEVICE:-gpu}}
"$HERE/gpu.sh"
"${PYTHON:-python3}" "$HERE/model_table.py" "$REPORTS" "${OUT:-$REPORTS}" "$RUNNERS" "$CASES"
