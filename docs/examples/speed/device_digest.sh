#!/usr/bin/env bash
# Step digests on the GPU (issue 33), on one H200, from the repository root, with the three wheels in .whl/
# (megatron-core 0.19.2 cp312, transformers 5.3.0, tokenizers 0.22.2) and OUT set to a folder for what comes back.
#
#   PARTS="test throughput" docs/examples/speed/device_digest.sh   # a few minutes
#   PARTS=train docs/examples/speed/device_digest.sh                # kimi_k2_2layer_train_full, 3 steps: its own call
#
# test        tests/test_bits128.py's GPU test: bits128v1 in torch on the GPU gives the host reference's bits for every
#             dtype a step holds, odd sizes, views, a tensor over several chunks (pytest if the interpreter has it)
# throughput  a 4 GB bf16 tensor: bits128v1 on the GPU against what a step's digest cost before (the tensor copied to
#             the host, then XXH3 there), the GPU's digest checked against the numpy host reference
# train       `compare kimi_k2_2layer_train_full` (Kimi-K2's widths, 4.4 G parameters, 79 GB of state per step and
#             side, every tensor digested on the GPU), Megatron vs HF, no truth; prints each side's phases (setup and
#             each step, the digests included) from its meta.json and copies the small reports to OUT
set -uo pipefail
OUT=${OUT:-/tmp/device_digest}
PARTS=${PARTS:-test throughput train}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L; nproc; free -g | head -2
python3 -W ignore -c "import torch, megatron.core as m, transformers as t; print('torch', torch.__version__, \
'| CUDA', torch.version.cuda, '| megatron-core', m.__version__, '| transformers', t.__version__)"
status=0
for part in $PARTS; do
    start=$(date +%s)
    case "$part" in
        test)
            if python3 -c "import pytest" 2>/dev/null; then
                python3 -m pytest tests/test_bits128.py -q -m gpu -p no:cacheprovider 2>&1 | tail -3
            else
                python3 -c "import tests.test_bits128 as t; t.test_on_the_gpu_torch_gives_the_host_references_bits(); \
print('GPU test passed (no pytest: called directly)')"
            fi || status=1 ;;
        throughput)
            python3 docs/examples/speed/device_digest.py --device cuda --mb 4096 --dtype bfloat16 \
                --json "$OUT/device_digest_gpu.json" 2>&1 | tee "$OUT/device_digest_gpu.log" || status=1 ;;
        train)
            rm -rf /tmp/train_full
            python3 -m harness compare kimi_k2_2layer_train_full --device gpu --runners megatron_model,hf_model \
                --no-oracle --timeout 3000 --reports /tmp/train_full 2>&1 | tee "$OUT/train_full.console.txt"
            run=$(ls -td /tmp/train_full/*/ 2>/dev/null | head -1)
            [ -n "$run" ] && cp "$run/report.json" "$run/report.md" "$OUT/" && python3 - "$run" <<'PY'
import json, sys
from pathlib import Path

run = Path(sys.argv[1])
report = json.loads((run / "report.json").read_text())
print(f"verdict {report['verdict']}; harness seconds {report.get('harness', {}).get('seconds')}")
for meta in sorted(run.glob("*/meta.json")):
    phases = json.loads(meta.read_text()).get("phases", {})
    steps = {k: v for k, v in phases.items() if k.startswith("step ")}
    print(f"{meta.parent.name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
          + (f"; steps {sum(steps.values()):.1f} s" if steps else ""))
PY
            ;;
        *) echo "unknown part $part (test, throughput, train)" >&2; status=2 ;;
    esac
    echo "== $part: $(( $(date +%s) - start )) s"
done
ls -la "$OUT"
exit $status
