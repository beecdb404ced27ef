#!/usr/bin/env bash
# GPU evidence for the training level (docs/training.md): N optimizer steps of the 2-layer Kimi-K2, Megatron-Core's
# training code against HF transformers + torch's, every state tensor after every step, on one GPU.
#
#   docs/examples/train/run.sh                      # both cases, one after the other
#   CASES=kimi_k2_2layer_train_bf16 docs/examples/train/run.sh   # one case per command (the lent GPU's 10-minute calls)
#
# Cases:
#   kimi_k2_2layer_train_bf16  reduced widths, 384 experts, 3 steps of 2 micro-batches, bf16 + fp32 masters, with the
#                              float64 truth (hf_model trained in float64) and the re-feed in time (--refeed: side b
#                              re-run twice from side a's state). A few minutes.
#   kimi_k2_2layer_train_full  Kimi-K2's widths, 32 experts, 512 tokens, 3 steps: 4.4 G parameters, 79 GB of state per
#                              step and side, so no step's tensors are kept (train.steps_kept = "none"): every tensor
#                              is compared by digest (bits128v1, computed on the GPU: 16 bytes per tensor come to the
#                              host; docs/speed.md), the scalars exactly; no truth (its float64 state would
#                              not fit). Each side needs about 100 GB of GPU memory; the sides run one after another.
#
# Environment (all optional):
#   PYTHON   interpreter with torch (CUDA), megatron-core, transformers, numpy, safetensors, ml_dtypes, rich  [python3]
#   CASES    cases to run                                   [kimi_k2_2layer_train_bf16 kimi_k2_2layer_train_full]
#   REPORTS  where the full runs go (step files included: large)                                 [reports/train]
#   DEST     where the small reports (report.json and report.md, no tensors) are copied        [docs/examples/train]
#   DEVICE   gpu, or cpu for a smoke test of this script                                                     [gpu]
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
CASES=${CASES:-kimi_k2_2layer_train_bf16 kimi_k2_2layer_train_full}
REPORTS=${REPORTS:-$ROOT/reports/train}
DEST=${DEST:-$HERE}
DEVICE=${DEVICE:-gpu}
read -r -a cases <<< "$CASES"

if ! "$PYTHON" -c "import numpy, safetensors, ml_dtypes, rich, xxhash, torch, megatron.core, transformers" 2>/dev/null; then
    echo "error: $PYTHON cannot import numpy, safetensors, ml_dtypes, rich, xxhash, torch, megatron.core and transformers" >&2
    exit 2
fi
"$PYTHON" -W ignore -c "import torch, megatron.core as m, transformers as t; print('torch', torch.__version__, \
'| CUDA', torch.version.cuda, '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else None, \
'| megatron-core', m.__version__, '| transformers', t.__version__)"

mkdir -p "$REPORTS" "$DEST"
status=0
for case in "${cases[@]}"; do
    case "$case" in
        *_full) extra=(--no-oracle) ;;
        *) extra=(--refeed) ;;
    esac
    started=$SECONDS
    echo "start $case ($DEVICE): megatron_model vs hf_model ${extra[*]}" >&2
    "$PYTHON" -m harness compare "$case" --device "$DEVICE" --runners megatron_model,hf_model "${extra[@]}" \
        --timeout 3000 --reports "$REPORTS/$case" | tee "$REPORTS/$case.console.txt"
    code=${PIPESTATUS[0]}
    echo "done $case in $((SECONDS - started)) s: exit code $code (0 equal, 1 a difference, 2 an error, 3 unsupported)" >&2
    [ "$code" -eq 2 ] && status=2
    run=$(ls -td "$REPORTS/$case"/*/ 2>/dev/null | head -1)
    if [ -n "$run" ]; then
        suffix=$([ "$DEVICE" = gpu ] && echo gpu || echo "$DEVICE")
        cp "$run/report.json" "$DEST/${case}_$suffix.json"
        cp "$run/report.md" "$DEST/${case}_$suffix.md"
        [ -f "$run/pictures/train_steps.png" ] && cp "$run/pictures/train_steps.png" "$DEST/${case}_${suffix}_steps.png"
        echo "small reports: $DEST/${case}_$suffix.{json,md}" >&2
    fi
done
exit $status
