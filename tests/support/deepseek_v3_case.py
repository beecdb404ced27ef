"""A tiny DeepSeek-V3 causal-LM case built from HF transformers' ``DeepseekV3ForCausalLM`` (its own random init,
seeded): the request and HF-named checkpoint of docs/model-contract.md, and the HF model itself as a reference.
Used by tests/test_megatron_model.py (a stand-in until the model case generator lands on main)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=12, rms_norm_eps=1e-6, rope_theta=50000.0,
            rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                          "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            routed_scaling_factor=2.827, scoring_func="sigmoid", topk_method="noaux_tc", n_group=1, topk_group=1,
            norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=False)

# The default case size of the brief (Kimi-K2 shape family, 2 layers, 384 experts top-8).
DEFAULT = dict(TINY, vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=32,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=384, num_experts_per_tok=8,
               q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
               rope_theta=50000.0, max_position_embeddings=131072,
               rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def hf_model(model: dict, dtype: torch.dtype, seed: int = 0, attn: str = "sdpa"):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = {k: v for k, v in model.items() if k not in ("rope_scaling", "rope_theta", "scoring_func", "topk_method")}
    rope = dict(model["rope_scaling"])
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = model["rope_theta"]
    config = DeepseekV3Config(**kwargs, rope_parameters=rope, attn_implementation=attn, experts_implementation="eager")
    torch.manual_seed(seed)
    net = DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to 1 and the expert bias to 0: make them informative
        for name, p in net.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for layer in net.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.01 * torch.randn(model["n_routed_experts"]))
    return net.to(dtype)


def checkpoint_tensors(net, model: dict) -> dict[str, torch.Tensor]:
    """HF checkpoint names and layout: routed experts per expert (gate_proj, up_proj, down_proj)."""
    out = {}
    inter = model["moe_intermediate_size"]
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


def make_case(folder: Path, model: dict, dtype: str, tokens: int, seed: int = 0):
    """Write checkpoint.safetensors and request.json into `folder`; return (request, HF model, input_ids, labels)."""
    torch_dtype = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    net = hf_model(model, torch_dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    input_ids = torch.randint(0, model["vocab_size"], (tokens,), generator=g)
    labels = torch.cat([input_ids[1:], torch.tensor([-100])])
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**checkpoint_tensors(net, model), "input_ids": input_ids, "labels": labels},
              str(folder / "checkpoint.safetensors"))
    request = {"case": f"tiny_deepseek_v3_{dtype}", "op": "causal_lm", "dtype": dtype, "device": "cpu", "tp": 1,
               "tokens": tokens, "config": {"model": model}, "checkpoint": [str(folder / "checkpoint.safetensors")],
               "output_dir": str(folder / "out")}
    (folder / "request.json").write_text(json.dumps(request))
    return request, net, input_ids, labels
