#!/usr/bin/env bash
# GPU evidence: Megatron-Core against plain PyTorch in both weight layouts (torch: [out, in], TN GEMM;
# torch_nn: [in, out], NN GEMM) for Kimi-K2's shared-expert fc1, fc2 and the MLA q_a (q_down) projection,
# each over a token sweep, on the GPU this runs on.
#
#   docs/examples/gpu/run.sh
#
# Environment (all optional):
#   PYTHON   interpreter with torch (CUDA), megatron-core, numpy, safetensors, ml_dtypes, rich  [python3]
#   TOKENS   token counts of the sweep                         [1,7,60,61,64,127,128,255,256,1024,4096]
#   CASES    cases to sweep                         [kimi_shared_fc1 kimi_shared_fc2 kimi_mla_q_down_proj]
#   REPORTS  where the full runs go (runner outputs included: large)               [reports/gpu-sweep]
#   OUT      if set, the small reports (JSON + Markdown, no tensors) are copied there too, under examples-gpu/
#   DEVICE   gpu, or cpu for a smoke test of this script                                            [gpu]
#   DEST     where the small reports are copied                                   [docs/examples/gpu]
# The three cases run at once (one GPU is plenty for these GEMMs); each prints a line per finished cell.
# The CPU truth oracle is left out (--no-oracle): 66 cells of exact fp64 GEMMs up to 4096 tokens would not fit.
# The small reports land in docs/examples/gpu/<case>.json and <case>.md, next to this script.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
TOKENS=${TOKENS:-1,7,60,61,64,127,128,255,256,1024,4096}
CASES=${CASES:-kimi_shared_fc1 kimi_shared_fc2 kimi_mla_q_down_proj}
REPORTS=${REPORTS:-$ROOT/reports/gpu-sweep}
DEVICE=${DEVICE:-gpu}
DEST=${DEST:-$HERE}
read -r -a cases <<< "$CASES"

if ! "$PYTHON" -c "import numpy, safetensors, ml_dtypes, rich, torch, megatron.core" 2>/dev/null; then
    echo "error: $PYTHON cannot import numpy, safetensors, ml_dtypes, rich, torch and megatron.core:" >&2
    "$PYTHON" -c "import numpy, safetensors, ml_dtypes, rich, torch, megatron.core" >&2
    exit 2
fi
"$PYTHON" -W ignore -c "import torch, megatron.core as m; print('torch', torch.__version__, '| CUDA', torch.version.cuda, \
'| device', torch.cuda.get_device_name() if torch.cuda.is_available() else None, '| megatron-core', m.__version__)"

repeat=()
if "$PYTHON" -m harness compare --help | grep -q -- "--repeat"; then
    repeat=(--repeat 2)
else
    echo "note: this checkout's harness has no --repeat option; each cell runs each runner once" >&2
fi

mkdir -p "$REPORTS"
started=$SECONDS
pids=()
for case in "${cases[@]}"; do
    echo "start $case: tokens $TOKENS, megatron vs torch and megatron vs torch_nn" >&2
    "$PYTHON" -m harness compare "$case" --device "$DEVICE" --tokens "$TOKENS" --runners megatron,torch \
        --runners megatron,torch_nn "${repeat[@]}" --no-oracle --timeout 300 --reports "$REPORTS/$case" \
        > "$REPORTS/$case.console.txt" &
    pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; code=$?
    echo "done ${cases[$i]}: exit code $code (0 all as expected, 1 a difference, 2 an error, 3 unsupported)" >&2
    [ "$code" -eq 2 ] && status=2
done

mkdir -p "$DEST"
for case in "${cases[@]}"; do
    sweep_dir=$(ls -d "$REPORTS/$case"/*-sweep-"$case"-* 2>/dev/null | tail -n 1)
    if [ -z "$sweep_dir" ]; then
        echo "error: no sweep report for $case under $REPORTS/$case" >&2; status=2; continue
    fi
    cp "$sweep_dir/report.json" "$DEST/$case.json"
    cp "$sweep_dir/report.md" "$DEST/$case.md"
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT/examples-gpu"
        cp "$sweep_dir/report.json" "$OUT/examples-gpu/$case.json"
        cp "$sweep_dir/report.md" "$OUT/examples-gpu/$case.md"
        cp "$REPORTS/$case.console.txt" "$OUT/examples-gpu/$case.console.txt"
    fi
    echo "$case: $sweep_dir/report.md -> $DEST/$case.md" >&2
done
echo "finished in $((SECONDS - started)) s" >&2
exit $status
