"""A DeepSeek-V4 reference run a user's own captured run is compared against (docs/model.md, "DeepSeek-V4").

The family's own reference is its training case (``deepseek_v4_2layer_train``, canonical names; docs/model.md
"DeepSeek-V4"). This is the same kind of run recorded the way a user's own DeepSeek-V4 training code records it:
transformers 5.23.0's own ``DeepseekV4ForCausalLM`` (a tiny one: 2 layers, one CSA and one HCA attention, one
hash-routed and one top-k MoE layer, 2 hyper-connection streams) is trained by torch AdamW and recorded in its own
parameter names (``harness.attach.torch.StepRecorder``, ``{"family": "own"}``: docs/attach.md "Any model"). Run it
in the environment that holds 5.23.0:

    PYTHONPATH=. .venv-hf523/bin/python docs/examples/zoo/deepseek_v4_reference.py runs/v4-reference
    PYTHONPATH=. .venv-hf523/bin/python docs/examples/zoo/deepseek_v4_reference.py runs/v4-flipped \
        --flip model.layers.1.self_attn.q_a_proj.weight      # a negative control: one bit of one weight
    python -m harness compare-runs runs/v4-reference runs/v4-flipped   # DIFF from step 1; a rerun: BITWISE_PASS

The same loop with the recorder in a user's own DeepSeek-V4 training code gives the run to compare.
"""

from __future__ import annotations

import argparse

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from harness.attach.torch import StepRecorder

TINY = {"vocab_size": 64, "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        "num_experts_per_tok": 2, "n_routed_experts": 8, "n_shared_experts": 1, "hc_mult": 2, "hc_sinkhorn_iters": 3,
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "mlp_layer_types": ["hash_moe", "moe"], "sliding_window": 4, "o_groups": 2, "o_lora_rank": 8,
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": 2,
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        "use_cache": False, "attn_implementation": "eager", "attention_dropout": 0.0}
STEPS, MICRO_BATCHES, TOKENS = 2, 2, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the run's step folder (new)")
    parser.add_argument("--flip", metavar="PARAMETER", help="flip the lowest bit of the parameter's first element "
                                                            "before training (a negative control)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = hf.DeepseekV4ForCausalLM(hf.DeepseekV4Config(**TINY))
    model.train()
    if args.flip:
        with torch.no_grad():
            model.get_parameter(args.flip).view(-1)[:1].view(torch.int32).bitwise_xor_(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    recorder = StepRecorder(args.folder, model, optimizer, {"family": "own"})
    data = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        losses = []
        for _ in range(MICRO_BATCHES):
            ids = torch.randint(0, TINY["vocab_size"], (1, TOKENS), generator=data)
            loss = model(input_ids=ids, labels=ids).loss / MICRO_BATCHES
            loss.backward()
            losses.append(loss.detach())
        grads = recorder.grads()
        norm, factor = recorder.clip_grad_norm_(model.parameters(), 1.0)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        recorder.record(step, losses, lr, grads, grad_norm=norm, clip_coeff=factor)
        optimizer.zero_grad()
    recorder.close()


if __name__ == "__main__":
    main()
