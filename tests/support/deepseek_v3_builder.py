"""DeepSeek-V3 ``causal_lm`` cases for the model-runner tests: the configs, an HF-named checkpoint and a request.json.

The checkpoint follows docs/model-contract.md: every parameter in HF checkpoint names and ``[out, in]`` layout,
routed experts per expert, the expert bias float32, ``input_ids`` and shifted ``labels`` (last one -100).

Two ways to make the weights, one writer:
- ``numpy_case``: numpy only (weights N(0, 0.02), norms 1 + N(0, 0.1), expert bias N(0, 0.01)), so the Paddle
  tests that need no reference run where torch and transformers are not installed; docs/examples/paddle-model
  measured these weights.
- ``hf_init_case``: HF transformers' own seeded init (norms and expert bias then drawn as above), returning the HF
  model too: the Megatron tests compare against that very model in their process (tests/support/hf_reference.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.support.hf_reference import hf_model

# The default case size: Kimi-K2's shape family at 2 layers (layer 0 dense), 384 experts top-8, 1 shared expert,
# Kimi-K2's YaRN and positions (harness/families/deepseek_v3/family.toml).
DEFAULT = {
    "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "q_lora_rank": 96,
    "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "rms_norm_eps": 1e-6,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 1,
    "topk_group": 1, "norm_topk_prob": True, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "attention_bias": False,
}

# Few experts, small widths: a float64 comparison in seconds. v_head_dim 12 != the qk head dim 24 (Megatron's MLA
# core attention is then given two head dims); YaRN over 64 original positions.
TINY = dict(DEFAULT, vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
            n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=2048,
            rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})

# What tests/test_paddle_model.py has always run (and docs/examples/paddle-model measured): YaRN factor 4 over 64
# original positions, 256 positions; the tiny one with v_head_dim 16.
SHORT_YARN = {"max_position_embeddings": 256,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                               "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
DEFAULT_SHORT_YARN = dict(DEFAULT, **SHORT_YARN)
TINY_SHORT_YARN = dict(TINY, v_head_dim=16, **SHORT_YARN)


def hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter's HF checkpoint name and shape, in the order numpy_case draws them."""
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


def write_case(folder: Path, config: dict, tensors: dict[str, np.ndarray], dtype: str, tokens: int,
               device: str = "cpu") -> Path:
    """checkpoint.safetensors (`tensors`) and request.json in `folder`; returns the request's path."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    checkpoint = folder / "checkpoint.safetensors"
    save_file(tensors, str(checkpoint))
    request = {"case": f"deepseek_v3_{dtype}", "op": "causal_lm", "dtype": dtype, "device": device, "tp": 1,
               "tokens": tokens, "config": {"model": config}, "checkpoint": [str(checkpoint)],
               "output_dir": str(folder / "out"), "shapes": {}}
    path = folder / "request.json"
    path.write_text(json.dumps(request))
    return path


def numpy_case(folder: Path, config: dict, tokens: int, dtype: str = "float32", device: str = "cpu",
               seed: int = 0) -> Path:
    """A case with numpy-drawn weights (bfloat16: drawn in float32, rounded; the expert bias stays float32)."""
    rng = np.random.default_rng(seed)
    draw = "float32" if dtype == "bfloat16" else dtype
    tensors = {}
    for name, shape in hf_shapes(config).items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = (rng.standard_normal(shape) * 0.01).astype(np.float32)
        elif name.endswith("norm.weight"):
            tensors[name] = (1.0 + rng.standard_normal(shape) * 0.1).astype(draw)
        else:
            tensors[name] = (rng.standard_normal(shape) * 0.02).astype(draw)
    if dtype == "bfloat16":
        import ml_dtypes

        tensors = {k: v if "e_score" in k else v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    ids = rng.integers(0, config["vocab_size"], size=tokens, dtype=np.int64)
    labels = np.concatenate([ids[1:], [-100]]).astype(np.int64)
    return write_case(folder, config, {**tensors, "input_ids": ids, "labels": labels}, dtype, tokens, device)


def hf_init_case(folder: Path, config: dict, dtype: str, tokens: int, seed: int = 0):
    """A case with HF's own seeded init (float64 or float32); returns (request, HF model, input_ids, labels)."""
    import torch

    net = hf_model(config, attn="sdpa", seed=seed)
    with torch.no_grad():  # HF initialises norms to 1 and the expert bias to 0: make them informative
        for name, p in net.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for layer in net.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.01 * torch.randn(config["n_routed_experts"]))
    net = net.to({"float64": torch.float64, "float32": torch.float32}[dtype])
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, config["vocab_size"], (tokens,), generator=g)
    labels = torch.cat([input_ids[1:], torch.tensor([-100])])
    tensors = {k: v.numpy() for k, v in _checkpoint_tensors(net, config).items()}
    path = write_case(folder, config, {**tensors, "input_ids": input_ids.numpy(), "labels": labels.numpy()}, dtype,
                      tokens)
    return json.loads(path.read_text()), net, input_ids, labels


def _checkpoint_tensors(net, config: dict) -> dict:
    """HF checkpoint names and layout from HF's model: routed experts per expert (gate_proj, up_proj, down_proj)."""
    out = {}
    inter = config["moe_intermediate_size"]
    for name, t in net.state_dict().items():
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif ".mlp.experts.down_proj" in name:
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        elif name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t
    return {k: v.contiguous().clone() for k, v in out.items()}
