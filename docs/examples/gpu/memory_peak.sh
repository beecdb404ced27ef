#!/usr/bin/env bash
# What a side of a GPU case needs (issue 40: a case states `gpu_memory_gib`): runs CASE (default
# kimi_k2_2layer_train_full, Megatron vs HF) on the device machine while nvidia-smi samples every GPU process's memory
# every 100 ms, then prints each process's peak. From the repository root, with the cp312 wheels in .whl/ (as
# docs/examples/speed/gpu_bench.sh) and OUT set to a folder for what comes back.
# Not run yet: written 2026-12-06, when no H200 could be had (docs/gpu-and-tp.md).
set -uo pipefail
OUT=${OUT:-/tmp/memory_peak}
CASE=${CASE:-kimi_k2_2layer_train_full}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L; nvidia-smi --query-gpu=memory.total --format=csv
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits -lms 100 \
    > "$OUT/samples.csv" 2>/dev/null &
sampler=$!
start=$(date +%s)
python3 -m harness compare "$CASE" --device gpu --runners megatron_model,hf_model --no-oracle --reports /tmp/memory_reports \
    2>&1 | tee "$OUT/console.txt" | tail -25
echo "compare: $(( $(date +%s) - start )) s"
kill "$sampler"
python3 - "$OUT/samples.csv" <<'PY'
import sys
peaks = {}
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 3 and parts[2].isdigit():
        peaks[parts[0]] = max(peaks.get(parts[0], 0), int(parts[2]))
for pid, mib in sorted(peaks.items(), key=lambda item: -item[1]):
    print(f"pid {pid}: peak {mib} MiB = {mib / 1024:.1f} GiB")
PY
run=$(ls -td /tmp/memory_reports/*/ 2>/dev/null | head -1)
[ -n "$run" ] && gzip -c "$run/report.json" > "$OUT/report.json.gz"
