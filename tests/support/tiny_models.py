"""One tiny config.model per family (two layers, a few experts): the wire dicts the per-family and the per-stack
tests build their models from, so that a test parametrized over every family reads them here."""

from tests.support.deepseek_v3_builder import TINY as DEEPSEEK_V3

TINY = {
    "deepseek_v3": {"family": "deepseek_v3", **DEEPSEEK_V3},
    "glm4_moe": {"family": "glm4_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "moe_intermediate_size": 32,
                 "n_routed_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128},
    "minimax_m2": {"family": "minimax_m2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 32, "rotary_dim": 16, "intermediate_size": 32,
                   "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128},
    "qwen2_moe": {"family": "qwen2_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
                  "vocab_size": 128},
    "glm_moe_dsa": {"family": "glm_moe_dsa", "num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"],
                    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
                    "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                    "qk_rope_head_dim": 8, "v_head_dim": 12, "index_n_heads": 2, "index_head_dim": 16,
                    "index_topk": 3},
    "qwen3_5_moe": {"family": "qwen3_5_moe", "num_hidden_layers": 2,
                    "layer_types": ["linear_attention", "full_attention"], "vocab_size": 128, "hidden_size": 64,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
                    "num_experts_per_tok": 2},
    "deepseek_v32": {"family": "deepseek_v32", "num_hidden_layers": 2, "first_k_dense_replace": 1,
                     "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 8, "n_group": 4,
                     "topk_group": 2, "num_experts_per_tok": 2, "q_lora_rank": 24, "kv_lora_rank": 16,
                     "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "index_n_heads": 2,
                     "index_head_dim": 16, "index_topk": 3},
    "qwen3_moe": {"family": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
                  "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
                  "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 128},
}
