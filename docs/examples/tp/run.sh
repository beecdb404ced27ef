#!/usr/bin/env bash
# Megatron-Core at TP=N against itself at TP=1 on GPUs (torchrun, NCCL), for the Kimi-K2 shared-expert fc1
# (column-parallel) and fc2 (row-parallel) at their full shapes. Copies each report (JSON + Markdown, no tensors)
# here as <case>_tp<N>_vs_tp1.{json,md}.
#
#   bash docs/examples/tp/run.sh            # TP=2 (needs 2 GPUs: the device tool's nvidia-h200-x2)
#   bash docs/examples/tp/run.sh 4 8        # TP=4 and TP=8 (4 and 8 GPUs); a TP larger than the GPU count is skipped
#   PYTHON=/envs/megatron/bin/python TOKENS=1024 bash docs/examples/tp/run.sh 2
#
# The interpreter needs torch (CUDA), megatron-core, numpy, safetensors, ml_dtypes and rich. Exit status: 0 when every
# run gave a verdict (BITWISE_PASS or DIFF: TP invariance is a finding), 1 when any run ended ERROR or UNSUPPORTED.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0   # NVLink multicast off, always (device notes)
PYTHON=${PYTHON:-python3}
TOKENS=${TOKENS:-4096}
HERE=docs/examples/tp
REPORTS=${REPORTS:-reports}
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "GPUs: $GPUS; python: $PYTHON; tokens: $TOKENS; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
"$PYTHON" -c "import torch, megatron.core, numpy, safetensors, ml_dtypes, rich; print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__)" || exit 1
status=0
for tp in "${@:-2}"; do
  if [ "$tp" -gt "$GPUS" ]; then
    echo "skip TP=$tp: needs $tp GPUs, this machine has $GPUS"; status=1; continue
  fi
  for case in kimi_shared_fc1 kimi_shared_fc2; do
    echo "=== $case: megatron TP=$tp vs TP=1, $TOKENS tokens"
    "$PYTHON" -m harness compare "$case" --device gpu --tp "$tp" --versus tp=1 --runner megatron \
      --tokens "$TOKENS" --reports "$REPORTS" --timeout 1200
    code=$?
    [ "$code" -le 1 ] || status=1
    run_dir=$(ls -td "$REPORTS"/*-"$case"-*/ 2>/dev/null | head -1)   # runs never overwrite: the newest is this one
    if [ -n "$run_dir" ]; then
      cp "$run_dir/report.md" "$HERE/${case}_tp${tp}_vs_tp1.md"
      cp "$run_dir/report.json" "$HERE/${case}_tp${tp}_vs_tp1.json"
    fi
  done
done
exit $status
