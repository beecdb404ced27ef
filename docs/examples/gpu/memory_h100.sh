#!/usr/bin/env bash
# On an 80 GB H100 (issue 40, finding 9): kimi_k2_2layer_train_full is refused before it runs (its gpu_memory_gib
# against nvidia-smi's total), and with that field taken out of a copy of the case, each side's death by out of
# memory is named in the verdict line. From the repository root, with the cp312 wheels in .whl/, OUT set.
set -uo pipefail
OUT=${OUT:-/tmp/memory_h100}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L; nvidia-smi --query-gpu=memory.total --format=csv
echo "== as committed (gpu_memory_gib = 80)"
python3 -m harness compare kimi_k2_2layer_train_full --device gpu --runners megatron_model,hf_model \
    --reports /tmp/r1 2>&1 | tee "$OUT/refused.console.txt" | tail -6
echo "== without gpu_memory_gib (this machine's copy of the case only)"
sed -i '/^gpu_memory_gib = 80$/d' cases/kimi_k2_train.toml
start=$(date +%s)
python3 -m harness compare kimi_k2_2layer_train_full --device gpu --runners megatron_model,hf_model \
    --reports /tmp/r2 2>&1 | tee "$OUT/oom.console.txt" | tail -12
echo "compare: $(( $(date +%s) - start )) s"
