#!/usr/bin/env bash
# The GPU bench (issue 33) on one H200, from the repository root, with the cp312 wheels in .whl/ (megatron-core
# 0.19.2, transformers 5.3.0, tokenizers 0.22.2, xxhash 3.6.0) and OUT set to a folder for what comes back. Each part
# fits one 10-minute device call:
#
#   BEFORE=.before PARTS="test train" docs/examples/speed/gpu_bench.sh   # BEFORE: an older tree (git archive)
#   PARTS="catalogue" JOBS="4 1" docs/examples/speed/gpu_bench.sh
#   BEFORE=.before PARTS=model docs/examples/speed/gpu_bench.sh
#
# test       the GPU tests (tests/test_bits128.py -m gpu: bits128v1 on the GPU against the host reference)
# train      kimi_k2_2layer_train_full (Kimi-K2's widths, 3 steps; on an H100 its _h100 twin), Megatron vs HF: the compare against the two bare
#            training loops, and each side's steps inside it against its bare loop's (goal 1.2x), before and after
# catalogue  every op-level GPU case at 11 token counts, JOBS cases at once sharing the GPU (goal under 300 s),
#            one run per JOBS value, in the order given
# model      kimi_k2_2layer_full (the model level at Kimi-K2's widths), Megatron vs HF, with where its time went,
#            BEFORE's tree first where one is given
set -uo pipefail
OUT=${OUT:-/tmp/gpu_bench}
PARTS=${PARTS:-test train}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi -L; nproc; free -g | head -2; uptime
python3 -W ignore -c "import torch, megatron.core as m, transformers as t; print('torch', torch.__version__, \
'| CUDA', torch.version.cuda, '| megatron-core', m.__version__, '| transformers', t.__version__)"
git log --oneline -1 2>/dev/null || true
# an H100 (79.2 GiB) cannot hold kimi_k2_2layer_train_full: there its _h100 twin (16 of 32 experts, vocabulary 32,768)
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ "${memory_mib:-0}" -ge 100000 ] && default_case=kimi_k2_2layer_train_full || default_case=kimi_k2_2layer_train_full_h100
TRAIN_CASE=${TRAIN_CASE:-$default_case}
echo "train case: $TRAIN_CASE (GPU memory $memory_mib MiB)"
status=0
for part in $PARTS; do
    start=$(date +%s)
    case "$part" in
        test)
            python3 -m pytest tests/test_bits128.py -q -m gpu -p no:cacheprovider 2>&1 | tail -3 || status=1 ;;
        train)
            python3 -m harness.commands.bench_speed --skip-compare --skip-sweep --skip-model \
                --train-case "$TRAIN_CASE" --train-runners megatron_model,hf_model --train-device gpu \
                ${BEFORE:+--before "$BEFORE"} --json "$OUT/gpu_train_bench.json" 2>&1 \
                | tee "$OUT/gpu_train_bench.log" || status=1 ;;
        catalogue)
            for jobs in ${JOBS:-1}; do
                python3 -m harness.commands.bench_speed --catalogue gpu --catalogue-jobs "$jobs" \
                    --json "$OUT/gpu_catalogue_jobs$jobs.json" > "$OUT/gpu_catalogue_jobs$jobs.log" 2>&1 || status=1
                tail -1 "$OUT/gpu_catalogue_jobs$jobs.log"
            done ;;
        model)  # each tree's whole compare, BEFORE's first, one right after the other
            for tree in ${BEFORE:+"$BEFORE"} .; do
                label=$([ "$tree" = . ] && echo after || echo before)
                rm -rf "/tmp/model_full_$label"
                tree_start=$(date +%s)
                (cd "$tree" && PYTHONPATH=/tmp/site:$PWD python3 -m harness compare kimi_k2_2layer_full --device gpu \
                    --runners megatron_model,hf_model --no-oracle --reports "/tmp/model_full_$label") 2>&1 \
                    | tee "$OUT/model_full_$label.console.txt" | tail -6
                echo "== model $label: $(( $(date +%s) - tree_start )) s"
                run=$(ls -td "/tmp/model_full_$label"/*/ 2>/dev/null | head -1)
                [ -n "$run" ] && gzip -c "$run/report.json" > "$OUT/model_full_${label}_report.json.gz" \
                    && python3 - "$run" <<'PY'
import json, sys
from pathlib import Path

run = Path(sys.argv[1])
report = json.loads((run / "report.json").read_text())
print(f"verdict {report['verdict']}; harness seconds {report.get('harness', {}).get('seconds')}")
for side in report.get("sides", []):
    print(f"{side['label']} ({side['runner']}): {side.get('wall_seconds', 0):.1f} s, phases "
          + ", ".join(f"{k} {v:.2f}" for k, v in side.get("meta", {}).get("phases", {}).items()))
PY
                rm -rf "/tmp/model_full_$label"
            done
            ;;
        *) echo "unknown part $part (test, train, catalogue, model)" >&2; status=2 ;;
    esac
    echo "== $part: $(( $(date +%s) - start )) s"
done
ls -la "$OUT"
exit $status
