#!/usr/bin/env bash
# The recorders at full width (issue 43) on one GPU, from the repository root, with the cp312 wheels in .whl/
# (megatron-core 0.19.2, transformers 5.3.0, tokenizers 0.22.2, huggingface_hub, xxhash 3.6.0, and for the HF Trainer
# accelerate 1.15.0 and psutil 7.2.2) and OUT set to a folder for what comes back. One device call, about 5 minutes:
#
#   docs/examples/speed/recorder_bench.sh                      # kimi_k2_2layer_train_full's widths (8 experts on an H100)
#   ARGS="--experts 16" docs/examples/speed/recorder_bench.sh  # another configuration (recorder_bench.py --help)
#
# Writes OUT/recorder_bench.json and OUT/recorder_bench.log: per loop (a Megatron-Core loop with and without
# MegatronStepRecorder, the HF Trainer with and without its callback) the seconds of each step bare, recorded and bare
# again, their medians, recorded / bare (goal <= 1.2), the peak GPU memory, and the configuration it ran.
set -uo pipefail
OUT=${OUT:-/tmp/recorder_bench}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi -L; nproc; free -g | head -2
python3 -W ignore -c "import torch, megatron.core as m, transformers as t, accelerate as a; print('torch', \
torch.__version__, '| CUDA', torch.version.cuda, '| megatron-core', m.__version__, '| transformers', t.__version__, \
'| accelerate', a.__version__)" || { echo "the HF Trainer needs accelerate (and psutil): put their wheels in .whl/" >&2
                                      exit 1; }
git log --oneline -1 2>/dev/null || true
python3 -W ignore docs/examples/speed/recorder_bench.py --json "$OUT/recorder_bench.json" ${ARGS:-} 2>&1 \
    | tee "$OUT/recorder_bench.log"
status=${PIPESTATUS[0]}
ls -la "$OUT"
exit "$status"
