"""DeepSeek-V3 configs, HF-named checkpoints and causal_lm requests for the model-runner tests (numpy only).

The case machinery's own checkpoint generator (op record ``causal_lm``) is built elsewhere; this one follows the
same contract (docs/model-contract.md) so the runner can be tested on its own: every parameter in HF checkpoint
names and ``[out, in]`` layout, routed experts per expert, the expert bias float32, ``input_ids`` and shifted
``labels`` (last one -100).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ROPE = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def default_config() -> dict:
    """The issue's default size: 2 layers (layer 0 dense), 384 experts top-8, 1 shared expert."""
    return {
        "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 384,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 96,
        "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0, "rope_scaling": dict(ROPE), "routed_scaling_factor": 2.827, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "attention_bias": False,
    }


def tiny_config() -> dict:
    """Few experts, small widths: a float64 comparison in seconds."""
    return {**default_config(), "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
            "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "q_lora_rank": 48,
            "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    h, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (config["vocab_size"], h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_a_proj.weight": (config["q_lora_rank"], h),
            p + "self_attn.q_a_layernorm.weight": (config["q_lora_rank"],),
            p + "self_attn.q_b_proj.weight": (heads * (nope + rope), config["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": (config["kv_lora_rank"] + rope, h),
            p + "self_attn.kv_a_layernorm.weight": (config["kv_lora_rank"],),
            p + "self_attn.kv_b_proj.weight": (heads * (nope + v), config["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": (h, heads * v),
        })
        if layer < config["first_k_dense_replace"]:
            f = config["intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
            continue
        f, experts = config["moe_intermediate_size"], config["n_routed_experts"]
        fs = f * config["n_shared_experts"]
        shapes.update({p + "mlp.gate.weight": (experts, h), p + "mlp.gate.e_score_correction_bias": (experts,),
                       p + "mlp.shared_experts.gate_proj.weight": (fs, h),
                       p + "mlp.shared_experts.up_proj.weight": (fs, h),
                       p + "mlp.shared_experts.down_proj.weight": (h, fs)})
        for e in range(experts):
            shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (f, h),
                           p + f"mlp.experts.{e}.up_proj.weight": (f, h),
                           p + f"mlp.experts.{e}.down_proj.weight": (h, f)})
    return shapes


def checkpoint(config: dict, tokens: int, dtype: str = "float32", seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes(config).items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = (rng.standard_normal(shape) * 0.01).astype(np.float32)
        elif name.endswith("norm.weight"):
            tensors[name] = (1.0 + rng.standard_normal(shape) * 0.1).astype(dtype)
        else:
            tensors[name] = (rng.standard_normal(shape) * 0.02).astype(dtype)
    ids = rng.integers(0, config["vocab_size"], size=tokens, dtype=np.int64)
    labels = np.concatenate([ids[1:], [-100]]).astype(np.int64)
    tensors.update({"input_ids": ids, "labels": labels})
    return tensors


def write_request(folder: Path, config: dict, tokens: int, dtype: str = "float32", device: str = "cpu",
                  seed: int = 0, extra_config: dict | None = None) -> Path:
    """A checkpoint file and a request.json for a runner; returns the request's path."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "checkpoint.safetensors"
    arrays = checkpoint(config, tokens, "float32" if dtype == "bfloat16" else dtype, seed)
    if dtype == "bfloat16":
        import ml_dtypes

        arrays = {k: v.astype(ml_dtypes.bfloat16) if v.dtype == np.float32 and "e_score" not in k else v
                  for k, v in arrays.items()}
    save_file(arrays, str(path))
    request = {"case": "test_causal_lm", "op": "causal_lm", "dtype": dtype, "device": device, "tp": 1,
               "tokens": tokens, "config": {"model": config, **(extra_config or {})}, "checkpoint": [str(path)],
               "output_dir": str(folder / "out"), "shapes": {}}
    request_path = folder / "request.json"
    request_path.write_text(json.dumps(request))
    return request_path
