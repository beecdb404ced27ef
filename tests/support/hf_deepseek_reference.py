"""HF transformers' DeepseekV3ForCausalLM (torch, CPU) on a causal_lm request, for the paddle_model tests.

    python tests/support/hf_deepseek_reference.py REQUEST.json OUT.safetensors

Imports torch and transformers only (PaddleFormers, once imported, switches transformers' torch support off, so
the two stay in separate processes). Writes the canonical tensors it can observe without recomputing anything:
module outputs by forward hooks, the router's top-k by wrapping ``route_tokens_to_experts`` (a method, not a module),
logits, the loss through HF's own ``ForCausalLMLoss`` (given the already shifted labels as ``shift_labels``), and
every parameter gradient (routed experts: slices of HF's fused 3-D parameters). Per-expert outputs are not modules
in HF's fused experts, so they are not written.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build(request: dict):
    cfg = dict(request["config"]["model"])
    rope = dict(cfg.pop("rope_scaling"))
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = cfg.pop("rope_theta")
    config = DeepseekV3Config(**cfg, rope_parameters=rope, rope_interleave=True, attn_implementation="eager")
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(DTYPES[request["dtype"]])
    tensors = {name: tensor for path in request["checkpoint"] for name, tensor in load_file(path).items()}
    state = {}
    experts = cfg["n_routed_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        if p + "0.gate_proj.weight" in tensors:
            state[p + "gate_up_proj"] = torch.stack([torch.cat([tensors.pop(p + f"{e}.gate_proj.weight"),
                                                                tensors.pop(p + f"{e}.up_proj.weight")], 0)
                                                     for e in range(experts)])
            state[p + "down_proj"] = torch.stack([tensors.pop(p + f"{e}.down_proj.weight") for e in range(experts)])
    ids, labels = tensors.pop("input_ids"), tensors.pop("labels")
    state.update(tensors)
    model_state = model.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            model_state[name].copy_(value.to(model_state[name].dtype))
    missing = set(n for n in model_state if not n.endswith("inv_freq")) - set(state)
    assert not missing, missing
    return model, config, ids, labels


def run(request: dict, out_path: str) -> None:
    model, config, ids, labels = build(request)
    model.train()
    captured: dict[str, np.ndarray] = {}
    modules = dict(model.named_modules())

    def keep(name, tensor):
        array = tensor.detach().cpu().numpy().copy()
        captured[name] = array[0] if array.ndim >= 3 and array.shape[0] == 1 else array

    def post(name, module_name):
        modules[module_name].register_forward_hook(lambda _m, _i, out: keep(name, out[0] if isinstance(out, tuple)
                                                                            else out))

    def pre(name, module_name):
        modules[module_name].register_forward_pre_hook(lambda _m, inputs: keep(name, inputs[0]))

    post("module.model.embed_tokens", "model.embed_tokens")
    post("module.model.norm", "model.norm")
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        for sub in ("input_layernorm", "self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj",
                    "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm", "self_attn.kv_b_proj",
                    "self_attn.o_proj", "post_attention_layernorm"):
            post(f"module.{p}.{sub}", f"{p}.{sub}")
        pre(f"module.{p}.self_attn.core_attention", f"{p}.self_attn.o_proj")
        post(f"module.{p}", p)
        if f"{p}.mlp.gate_proj" in modules:
            parts = {}

            def part(which, out, name=f"module.{p}.mlp.gate_up_proj", parts=parts):
                parts[which] = out.detach().cpu().numpy()[0]
                if len(parts) == 2:
                    captured[name] = np.concatenate([parts["gate"], parts["up"]], axis=-1)

            modules[f"{p}.mlp.gate_proj"].register_forward_hook(lambda _m, _i, out, part=part: part("gate", out))
            modules[f"{p}.mlp.up_proj"].register_forward_hook(lambda _m, _i, out, part=part: part("up", out))
            pre(f"module.{p}.mlp.act", f"{p}.mlp.down_proj")
            post(f"module.{p}.mlp.down_proj", f"{p}.mlp.down_proj")
        else:
            moe = modules[f"{p}.mlp"]
            route = moe.route_tokens_to_experts

            def wrapped(logits, route=route, p=p, experts=config.n_routed_experts):
                indices, weights = route(logits)
                idx = indices.detach().numpy()
                captured[f"module.{p}.mlp.gate.topk_indices"] = np.sort(idx, axis=-1).astype(np.int64)
                probs = np.zeros((idx.shape[0], experts), dtype=weights.detach().numpy().dtype)
                np.put_along_axis(probs, idx, weights.detach().numpy(), axis=-1)
                captured[f"module.{p}.mlp.gate.probs"] = probs
                return indices, weights

            moe.route_tokens_to_experts = wrapped
            post(f"module.{p}.mlp.shared_experts", f"{p}.mlp.shared_experts")
            post(f"module.{p}.mlp", f"{p}.mlp")
    out = model(input_ids=ids.reshape(1, -1))
    loss = model.loss_function(out.logits, None, vocab_size=config.vocab_size, shift_labels=labels.reshape(1, -1))
    keep("logits", out.logits)
    captured["loss"] = loss.detach().numpy().reshape(())
    loss.backward()
    for name, param in model.named_parameters():
        grad = param.grad.detach().numpy()
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            stem, kind = name.rsplit(".", 1)
            for e in range(grad.shape[0]):
                captured[f"grad.{stem}.{e}.{kind}.weight"] = grad[e].copy()
        elif name.endswith("mlp.gate_proj.weight") or name.endswith("shared_experts.gate_proj.weight"):
            up = dict(model.named_parameters())[name.replace("gate_proj", "up_proj")].grad.detach().numpy()
            captured["grad." + name.replace("gate_proj", "gate_up_proj")] = np.concatenate([grad, up], axis=0)
        elif not name.endswith("up_proj.weight") or "gate_up" in name:
            captured["grad." + name] = grad.copy()
    save_file({k: np.array(v, order="C") for k, v in captured.items()}, out_path)  # (ascontiguousarray: 0-d -> 1-d)


if __name__ == "__main__":
    run(json.loads(open(sys.argv[1]).read()), sys.argv[2])
