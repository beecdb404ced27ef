#!/usr/bin/env bash
# GPU evidence for training across ranks (docs/training-ranks.md): the 2-layer Kimi-K2 trained at DP=2 and EP=2 on two
# GPUs (torchrun, NCCL), each stack against itself at DP=1 / EP=1 on the same global batch and Megatron-Core against
# HF transformers + torch with both at DP=2. Needs 2 GPUs (the device tool's nvidia-h200-x2); not run yet.
#
#   docs/examples/train/run_ranks.sh                        # every run below, one after the other
#   RUNS="megatron_dp megatron_ep" docs/examples/train/run_ranks.sh   # some of them (the lent GPUs' 10-minute calls)
#
# Runs (case kimi_k2_2layer_train_bf16 unless named; bf16 with fp32 masters, 3 steps of 2 micro-batches, the float64
# truth on one GPU):
#   megatron_dp        megatron_model DP=2 vs DP=1                      (--dp 2 --versus dp=1)
#   megatron_distopt   the same with the distributed optimizer          (kimi_k2_2layer_train_bf16_distopt)
#   megatron_ep        megatron_model EP=2 vs EP=1, both DP=2           (--dp 2 --ep 2 --versus ep=1)
#   hf_dp              hf_model (torch DDP) DP=2 vs DP=1                (--dp 2 --versus dp=1 --runner hf_model)
#   megatron_hf_dp2    megatron_model vs hf_model, both at DP=2         (--dp 2)
#   megatron_mb4       megatron_model DP=2 vs DP=1, 4 micro-batches a step: two per rank before the reduction
#                      (kimi_k2_2layer_train_bf16_mb4)
#
# Environment (all optional):
#   PYTHON   interpreter with torch (CUDA), megatron-core, transformers, numpy, safetensors, ml_dtypes, rich  [python3]
#   RUNS     runs to make (above)                                                                       [all of them]
#   REPORTS  where the full runs go (step files included)                                          [reports/ranks]
#   DEST     where the small reports (report.json and report.md, no tensors) are copied          [docs/examples/train]
#   DEVICE   gpu, or cpu for a smoke test of this script (gloo; the bf16 cases list only the gpu, so on a CPU
#            use RUNS="megatron_dp megatron_ep hf_dp megatron_hf_dp2")                                          [gpu]
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0   # NVLink multicast off, always (the device notes); the harness sets it too on --device gpu
PYTHON=${PYTHON:-python3}
RUNS=${RUNS:-megatron_dp megatron_distopt megatron_ep hf_dp megatron_hf_dp2 megatron_mb4}
REPORTS=${REPORTS:-$ROOT/reports/ranks}
DEST=${DEST:-$HERE}
DEVICE=${DEVICE:-gpu}
read -r -a runs <<< "$RUNS"

if [ "$DEVICE" = gpu ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$gpus" -lt 2 ]; then
        echo "error: DP=2 and EP=2 need 2 GPUs; nvidia-smi lists $gpus" >&2
        exit 2
    fi
fi
if ! "$PYTHON" -c "import numpy, safetensors, ml_dtypes, rich, xxhash, torch, megatron.core, transformers" 2>/dev/null; then
    echo "error: $PYTHON cannot import numpy, safetensors, ml_dtypes, rich, xxhash, torch, megatron.core and transformers" >&2
    exit 2
fi
"$PYTHON" -W ignore -c "import torch, megatron.core as m, transformers as t; print('torch', torch.__version__, \
'| CUDA', torch.version.cuda, '| NCCL', torch.cuda.nccl.version() if torch.cuda.is_available() else None, \
'| GPUs', torch.cuda.device_count(), '| megatron-core', m.__version__, '| transformers', t.__version__)"

arguments() {
    case "$1" in
        megatron_dp)      echo "kimi_k2_2layer_train_bf16 --dp 2 --versus dp=1 --runner megatron_model" ;;
        megatron_distopt) echo "kimi_k2_2layer_train_bf16_distopt --dp 2 --versus dp=1 --runner megatron_model" ;;
        megatron_ep)      echo "kimi_k2_2layer_train_bf16 --dp 2 --ep 2 --versus ep=1 --runner megatron_model" ;;
        hf_dp)            echo "kimi_k2_2layer_train_bf16 --dp 2 --versus dp=1 --runner hf_model" ;;
        megatron_hf_dp2)  echo "kimi_k2_2layer_train_bf16 --dp 2 --runners megatron_model,hf_model" ;;
        megatron_mb4)     echo "kimi_k2_2layer_train_bf16_mb4 --dp 2 --versus dp=1 --runner megatron_model" ;;
        *) return 1 ;;
    esac
}

mkdir -p "$REPORTS" "$DEST"
status=0
for run in "${runs[@]}"; do
    if ! args=$(arguments "$run"); then
        echo "error: unknown run $run (known: megatron_dp megatron_distopt megatron_ep hf_dp megatron_hf_dp2 \
megatron_mb4)" >&2
        status=2
        continue
    fi
    read -r -a args <<< "$args"
    started=$SECONDS
    echo "start $run ($DEVICE): compare ${args[*]}" >&2
    "$PYTHON" -m harness compare "${args[@]}" --device "$DEVICE" --timeout 1800 --reports "$REPORTS/$run" \
        | tee "$REPORTS/$run.console.txt"
    code=${PIPESTATUS[0]}
    echo "done $run in $((SECONDS - started)) s: exit code $code (0 equal, 1 a difference, 2 an error, 3 unsupported)" >&2
    [ "$code" -ge 2 ] && status=2
    dir=$(ls -td "$REPORTS/$run"/*/ 2>/dev/null | head -1)
    if [ -n "$dir" ]; then
        suffix=$([ "$DEVICE" = gpu ] && echo gpu || echo "$DEVICE")
        cp "$dir/report.json" "$DEST/ranks_${run}_$suffix.json"
        cp "$dir/report.md" "$DEST/ranks_${run}_$suffix.md"
        echo "small reports: $DEST/ranks_${run}_$suffix.{json,md}" >&2
    fi
done
exit $status
