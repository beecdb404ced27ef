#!/usr/bin/env bash
# Batch invariance of Kimi-K2's ops (docs/batch-invariance.md): each op's rows alone against the same rows inside
# batches of M = 1, 2, 4, ..., 64 other rows (`compare CASE --versus batch=1..64 --runner R`), per stack, and a table
# of which ops keep their bits. On a machine with 2 or more GPUs it also checks NCCL's collectives against the
# correctly rounded sum (`python -m harness reductions --device gpu`).
#
#   docs/examples/batch/gpu.sh                                                  # on a GPU: Megatron-Core and torch
#   DEVICE=cpu RUNNERS="megatron torch paddle" docs/examples/batch/gpu.sh       # the CPU table in the docs
#
# Environment (all optional):
#   PYTHON   interpreter with torch, numpy, safetensors, ml_dtypes, rich (and megatron-core for its column)
#                                                                                                    [python3]
#   DEVICE   gpu or cpu                                                                                [gpu]
#   RUNNERS  the stacks                                                                    [megatron torch]
#   BATCH    the M of --versus batch                                                                 [1..64]
#   JOBS     cases at a time                                                                             [1]
#   CASES    the cases (table rows; NAME@TOKENS runs NAME at that token count)     [Kimi-K2's ops, below]
#   OUT      if set: table.json, table.md and log.txt are written there (else in REPORTS)
#   REPORTS  where the full runs go (runner outputs included)                       [reports/batch-<device>]
# The truth oracle is left out (--no-oracle): this measures each stack against itself; a run's own report
# (`compare CASE --versus batch=M`, oracle on) adds each side's distance from the truth.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-gpu}
RUNNERS=${RUNNERS:-megatron torch}
BATCH=${BATCH:-1..64}
JOBS=${JOBS:-1}  # cases run at a time (each its own processes; on a GPU host with many cores, 8 fit)
# GEMMs of each projection (MLA q_a, kv_a, q_b, kv_b, attention out; the shared expert's fc1 and fc2; a routed
# expert's fc1 and fc2 at 16 tokens: without Transformer Engine its grouped GEMM is one GEMM per expert, of these
# shapes), then the rest of a layer. Routed experts, MoE combine and the LM loss mix rows by definition: refused.
CASES=${CASES:-kimi_mla_q_a kimi_mla_kv_a kimi_mla_q_b kimi_mla_kv_b kimi_attn_out_proj kimi_shared_fc1 \
kimi_shared_fc2 kimi_shared_fc1@16 kimi_shared_fc2@16 kimi_shared_mlp kimi_rmsnorm kimi_swiglu kimi_yarn_rope \
kimi_attention_scores kimi_core_attention kimi_router kimi_embedding kimi_routed_experts kimi_moe_combine kimi_lm_head}
REPORTS=${REPORTS:-$ROOT/reports/batch-$DEVICE}
DEST=${OUT:-$REPORTS}
mkdir -p "$REPORTS" "$DEST"
LOG=$DEST/log.txt
read -r -a cases <<< "$CASES"
read -r -a runners <<< "$RUNNERS"

if ! "$PYTHON" -c "import numpy, safetensors, ml_dtypes, rich, torch" 2>/dev/null; then
    echo "error: $PYTHON cannot import numpy, safetensors, ml_dtypes, rich and torch (the harness needs them):" >&2
    "$PYTHON" -c "import numpy, safetensors, ml_dtypes, rich, torch" >&2
    exit 2
fi
if [[ " ${runners[*]} " == *" megatron "* ]] && ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    echo "warning: $PYTHON cannot import megatron.core: the megatron column will say UNSUPPORTED" >&2
fi
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    "$PYTHON" -W ignore -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| device', \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    grep -m1 "model name" /proc/cpuinfo
} >> "$LOG" 2>&1

one() {  # one case on one stack over every M; its log apart, appended to the whole log when it ends
    local entry=$1 runner=$2 case_name=${1%@*} tokens=() part="$REPORTS/$1-$2.log"
    [[ $entry == *@* ]] && tokens=(--tokens "${entry#*@}")
    { echo "== $entry $runner"
      "$PYTHON" -m harness compare "$case_name" "${tokens[@]}" --versus "batch=$BATCH" --runner "$runner" \
          --device "$DEVICE" --no-oracle --reports "$REPORTS/$entry-$runner" 2>&1
      echo "exit $?"; } > "$part"
    cat "$part" >> "$LOG" && rm "$part"
}
for entry in "${cases[@]}"; do
    for runner in "${runners[@]}"; do
        while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done  # at most JOBS cases at a time
        one "$entry" "$runner" &
    done
done
wait

gpus=0
[[ $DEVICE == gpu ]] && gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if (( gpus >= 2 )); then
    ranks=$(seq -s, 2 "$(( gpus < 8 ? gpus : 8 ))")
    echo "== reductions over $ranks ranks" >> "$LOG"
    "$PYTHON" -m harness reductions --device gpu --ranks "$ranks" --reports "$REPORTS" >> "$LOG" 2>&1
    echo "exit $?" >> "$LOG"
fi

"$PYTHON" - "$REPORTS" "$DEST" "$RUNNERS" "$CASES" <<'EOF'
"""table.json and table.md: per case and stack, the M over which every tensor's bits hold, or the first M and tensor
whose bits depend on the batch (read from each run's batch report.json)."""
import json
import sys
from pathlib import Path

reports, dest, runners, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()


def cell(folder: Path) -> dict:
    found = sorted(folder.glob("*batch-*/report.json"))
    if not found:
        log = sorted(folder.glob("*/report.json"))
        return {"text": "no batch report (see log.txt)" if not log else json.loads(log[-1].read_text())["verdict"]}
    report = json.loads(found[-1].read_text())
    s = report["summary"]
    if s["invariant"]:
        return {"text": "invariant", "report": report}
    if s["first_m"] is None:
        first = report["cells"][0]
        text = first["verdict"] + (": " + first["message"].split(": ", 1)[-1][:90] if first["message"] else "")
        return {"text": text, "report": report}
    first = next(c for c in report["cells"] if c["others"] == s["first_m"])
    t = first["tensors"].get(s["first_tensor"], {})
    holds = [c["others"] for c in report["cells"] if c["verdict"] == "BITWISE_PASS"]
    text = (f"from M={s['first_m']}: {s['first_tensor']} {t.get('mismatches')} el., max {t.get('max_ulp')} ULP; "
            f"holds at M={','.join(map(str, holds)) or 'none'}")
    return {"text": text, "report": report}


table = {}
for entry in cases:
    table[entry] = {runner: cell(reports / f"{entry}-{runner}") for runner in runners}
rows = ["| case | " + " | ".join(runners) + " |", "|---|" + "---|" * len(runners)]
rows += [f"| {entry} | " + " | ".join(table[entry][r]["text"] for r in runners) + " |" for entry in cases]
(dest / "table.md").write_text("\n".join(rows) + "\n")
(dest / "table.json").write_text(json.dumps(
    {entry: {r: {"text": c["text"], "summary": c.get("report", {}).get("summary"),
                 "cells": [{**{k: v for k, v in x.items() if k not in ("message", "tensors")},  # tensors that moved:
                            "tensors": {n: t for n, t in x["tensors"].items() if t.get("status") != "EQUAL"}}
                           for x in c.get("report", {}).get("cells", [])]}
             for r, c in by.items()} for entry, by in table.items()}, indent=1, default=str))
print("\n".join(rows))
EOF
