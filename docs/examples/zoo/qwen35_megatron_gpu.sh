#!/usr/bin/env bash
# Qwen3.5-MoE, Megatron-Core 0.19.2 against HF transformers, on one H100 or H200 (issue 44), from the repository
# root, with the cp312 wheels in .whl/ (megatron-core 0.19.2, flash-linear-attention 0.6.0, fla-core 0.6.0, einops,
# transformers 5.3.0, ...) and in .whl523/ those of the environment "transformers-5.23.0" (dsa_gpu.sh says how to
# get them), OUT set to where the small reports go:
#
#   OUT=/tmp/out docs/examples/zoo/qwen35_megatron_gpu.sh
#
# flash-linear-attention goes to the Megatron side only. Megatron's GatedDeltaNet constructs only with fla and
# normalises q and k with fla's Triton l2norm; with deterministic_mode (the harness sets it) its conv and delta rule are
# torch code, not fla's chunk kernel, whose backward fla 0.6.0 refuses on Hopper with the image's triton 3.6.0.
# transformers takes fla's kernels whenever fla imports, so the HF side must not see it. Hence: every wheel but fla's in
# /tmp/site as gpu_cases.sh's install_wheels puts them (the machine's interpreter and the transformers-5.23.0
# environment both read it); fla in /tmp/site-fla, which only the Megatron side's interpreter puts on its path
# (HARNESS_PYTHON_MEGATRON_MODEL=/tmp/python-fla: the machine's python3 with PYTHONPATH=/tmp/site-fla in front); the HF
# side (HARNESS_PYTHON_HF_MODEL: its torch paths) on HF=5.3.0 (default: the carried wheel in /tmp/site, the release
# the family's record describes) or HF=5.23.0 (its environment, .venv-hf523; 5.23.0 rounds the routing weights to
# bf16, which the record refuses: docs/model.md). Checks both before running, then runs the
# reduced-width GPU cases of cases/qwen3_5_moe.toml and cases/qwen3_5_moe_train.toml (model level, the
# Megatron-vs-Megatron control, 3 training steps); CASES may add the _full twins (qwen3_5_moe_2layer_full_megatron
# qwen3_5_moe_2layer_train_full_megatron; longer). Prints each verdict line and whether it met the case's expectation;
# exits 1 if a check fails or a run ends in ERROR. Run on one NVIDIA H200 on 2026-12-06 with HF=5.23.0 (docs/model.md,
# Qwen3.5-MoE); HF=5.3.0 has never run on a GPU (2026-12-07: no machine came).
set -uo pipefail
OUT=${OUT:-/tmp/qwen35-megatron}
CASES=${CASES:-qwen3_5_moe_2layer_megatron qwen3_5_moe_2layer_megatron_control qwen3_5_moe_2layer_train_megatron_gpu}
mkdir -p "$OUT"
. "$(dirname "$0")/gpu_cases.sh"
FLA=$(ls .whl/fla_core-*.whl .whl/flash_linear_attention-*.whl) || { echo "no fla wheels in .whl/"; exit 1; }
WHEELS=$(ls .whl/*.whl | grep -v -e /fla_core- -e /flash_linear_attention-) install_wheels || exit 1
# dsa_gpu.sh puts every wheel in /tmp/site, fla's too: on a machine it ran on first, take fla back out (2026-12-06).
rm -rf /tmp/site/fla /tmp/site/fla_core-* /tmp/site/flash_linear_attention-*
# shellcheck disable=SC2086  # FLA: two wheel paths
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-fla $FLA \
    || exit 1
printf '#!/bin/sh\nPYTHONPATH="/tmp/site-fla${PYTHONPATH:+:$PYTHONPATH}" exec %s "$@"\n' "$(command -v python3)" \
    > /tmp/python-fla
chmod +x /tmp/python-fla || exit 1
HF=${HF:-5.3.0}
case $HF in
    5.3.0) HF_PYTHON=$(command -v python3) ;;
    5.23.0) [ -e .venv-hf523/.installed ] || PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl523 python3 -m harness.environments \
                transformers-5.23.0 || exit 1
            HF_PYTHON=$PWD/.venv-hf523/bin/python ;;
    *) echo "HF=$HF: the HF side runs on 5.3.0 or 5.23.0"; exit 1 ;;
esac
export HARNESS_PYTHON_MEGATRON_MODEL=/tmp/python-fla HARNESS_PYTHON_HF_MODEL=$HF_PYTHON
"$HARNESS_PYTHON_MEGATRON_MODEL" -W ignore -c "import torch, triton, fla, megatron.core as m
from megatron.core.ssm.gated_delta_net import common
print('Megatron side: torch', torch.__version__, '| device', torch.cuda.get_device_name(), '| megatron-core',
      m.__version__, '| fla', fla.__version__, '| triton', triton.__version__, '| HAVE_FLA', common.HAVE_FLA)
assert common.HAVE_FLA" || { echo "the Megatron side cannot import fla: nothing run"; exit 1; }
"$HARNESS_PYTHON_HF_MODEL" -W ignore -c "import importlib.util, transformers as t
print('HF side: transformers', t.__version__, t.__file__, '| fla importable:',
      importlib.util.find_spec('fla') is not None)
assert t.__version__ == '$HF' and importlib.util.find_spec('fla') is None" \
    || { echo "the HF side is not transformers $HF without fla: nothing run"; exit 1; }
TIMEOUT=300
run_cases
