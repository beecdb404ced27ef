"""Tiny training cases (op causal_lm_train) for the tests: a 2-layer DeepSeek-V3 with 8 experts top-2 (or a 2-layer
GLM-4.5 MoE, TINY_GLM) and widths of a few dozen, 8 tokens, 2 steps of 2 micro-batches: one side trains in about a
second."""

from __future__ import annotations

import json

from harness import CompareOptions, compare_case
from harness.run import steps
from tests.support.cases import tiny_case

TINY_MODEL = {"family": "deepseek_v3", "num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 96,
              "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "vocab_size": 128}
# GLM-4.5 MoE (glm4_moe) at the same size: q, k and v fused per query group on Megatron and Paddle (2 groups of 2
# query heads), q/k/v biases, partial RoPE, 16 experts top-2 (at 8 tokens some get none: Paddle's GLM MoE never calls
# those, so they have no gradient there)
TINY_GLM = {"family": "glm4_moe", "num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96,
            "moe_intermediate_size": 32, "n_routed_experts": 16, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "vocab_size": 128}
TINY_TRAIN = {"steps": 2, "micro_batches": 2, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 0, "decay_steps": 2}
# SGD with momentum (harness/optimizers/sgd.py): a schedule all three stacks compute alike (1e-2 -> 1e-3 would not:
# Megatron's cosine gives 0.010000000000000002 at step 1, HF's 0.01)
TINY_SGD = {**TINY_TRAIN, "optimizer": "sgd", "momentum": 0.9, "lr": 1e-2, "min_lr": 5e-3}


def tiny_train_case(name: str = "tiny_train", **fields) -> str:
    """One training case table in TOML; `fields` override (a field set to None is left out)."""
    table = {"family": "train", "op": "causal_lm_train", "dtype": "float32", "seed": 7, "tokens": 8,
             "runners": ["megatron_model", "hf_model"], "devices": ["cpu"], "config": {"model": TINY_MODEL},
             "train": TINY_TRAIN, "expect": {}, "shapes": None, **fields}
    return tiny_case(name, **table)


def run_train_case(name, cases, tmp_path, checkpoints_dir, **options):
    """compare_case on a written cases folder: the result, its run folder, report.json, and the stderr tails of the
    sides that did not end ok (what a failing assertion shows)."""
    result, run_dir = compare_case(name, CompareOptions(cases_dir=cases, checkpoints_dir=checkpoints_dir,
                                                        reports_dir=tmp_path / "reports", **options))
    report = json.loads((run_dir / "report.json").read_text())
    tails = "\n".join(s["stderr_tail"][-2500:] for s in report["sides"] if s["status"] != "ok")
    return result, run_dir, report, tails


def whole_steps(folder) -> list[str]:
    """The step files in a run's `folder` that hold their state tensors whole (a file being written is skipped)."""
    whole = []
    for path in sorted((folder / steps.STEPS_DIR).glob("step*.safetensors")):
        try:
            if steps.read_header(path).kept:
                whole.append(path.name)
        except Exception:  # a file being written (the code before step files appeared whole)
            continue
    return whole
