#!/usr/bin/env bash
# The model zoo on one H200 (issue 34): each family's 2-layer case (bf16, 64 tokens, with the float64 truth: hf_model
# in float64 on the same checkpoint) and its `_full` twin (the real model's widths, 512 tokens, no truth), Megatron-Core
# against HF transformers; then each family's training case in bf16. From the repository root, with the three wheels in
# .whl/ (megatron-core 0.19.2 cp312, transformers 5.3.0, tokenizers 0.22.2) and OUT set to where the small reports go:
#
#   OUT=/tmp/out docs/examples/zoo/run.sh
#   OUT=/tmp/out CASES="qwen3_moe_2layer qwen3_moe_2layer_full" docs/examples/zoo/run.sh
#
# Each run folder (dumps included) is deleted once its report.{json,md} is copied to OUT as <case>_gpu.{json,md}: the
# lent machine's 64 GiB disk holds one full twin's dumps at a time. The last lines print, per case, the verdict, the
# gradients bitwise equal, where the bits first part and which side the float64 truth finds closer.
set -uo pipefail
OUT=${OUT:-/tmp/families}
CASES=${CASES:-glm4_moe_2layer qwen3_moe_2layer minimax_m2_2layer glm4_moe_2layer_full qwen3_moe_2layer_full \
minimax_m2_2layer_full glm4_moe_2layer_train_bf16 qwen3_moe_2layer_train_bf16 minimax_m2_2layer_train_bf16}
mkdir -p "$OUT"
if ! python3 -c "import megatron.core, transformers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -W ignore -c "import torch, megatron.core as m, transformers as t; print('torch', torch.__version__, \
'| CUDA', torch.version.cuda, '| device', torch.cuda.get_device_name(), '| megatron-core', m.__version__, \
'| transformers', t.__version__)"
status=0
for case in $CASES; do
    extra=()
    [[ "$case" == *_full ]] && extra=(--no-oracle)
    start=$(date +%s)
    rm -rf /tmp/families_runs
    python3 -m harness compare "$case" --device gpu --runners megatron_model,hf_model "${extra[@]}" --timeout 1200 \
        --reports /tmp/families_runs > "$OUT/${case}_gpu.console.txt" 2>&1
    code=$?
    [ "$code" -eq 2 ] && status=2
    run=$(ls -td /tmp/families_runs/*/ 2>/dev/null | head -1)
    if [ -n "$run" ]; then
        cp "$run/report.json" "$OUT/${case}_gpu.json"
        cp "$run/report.md" "$OUT/${case}_gpu.md"
    fi
    echo "== $case: exit $code in $(( $(date +%s) - start )) s"
    tail -4 "$OUT/${case}_gpu.console.txt"
done
rm -rf /tmp/families_runs
python3 - "$OUT" <<'PY'
import json, sys
from collections import Counter
from pathlib import Path

for path in sorted(Path(sys.argv[1]).glob("*_gpu.json")):
    r = json.loads(path.read_text())
    m, t, truth = r.get("model") or {}, r.get("train") or {}, r.get("versus_oracle") or {}
    grads = m.get("gradients") or {}
    print(f"{r['case_name']}: {r['verdict']} (exit {r['exit_code']}); gradients bitwise {grads.get('bitwise_pass')} "
          f"of {grads.get('total')} (idle experts {grads.get('bitwise_pass_of_idle_experts')}); first divergence "
          f"{r.get('first_divergence')}; first gradient {m.get('first_gradient_divergence')}; train first "
          f"{t.get('first_divergence')}; truth {truth.get('status')} closer {dict(Counter((truth.get('closer') or {}).values()))}; "
          f"{r['started_at']} to {r['finished_at']}")
PY
exit $status
