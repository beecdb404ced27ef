"""fp32: the ops of one DeepSeek-V3 step, each run by Paddle and by torch on identical inputs (HF's captured module
outputs), with the number of elements whose bits differ. Imports both frameworks in one process (a diagnostic, not a
runner).

    python docs/examples/paddle-model/fp32_recipes.py RUN_FOLDER
RUN_FOLDER holds checkpoint.safetensors (tests/support/deepseek_v3_builder.py numpy_case, DEFAULT_SHORT_YARN, 64
tokens, float32) and hf.safetensors (python -m tests.support.hf_reference on the same request).
"""
import sys
import numpy as np
import torch, paddle
import torch.nn.functional as TF
import paddle.nn.functional as PF
from safetensors.numpy import load_file
hf = load_file(sys.argv[1] + "/hf.safetensors")
ck = load_file(sys.argv[1] + "/checkpoint.safetensors")
def nd(a, b): return int((a.view(np.uint32) != b.view(np.uint32)).sum()), a.size
x = hf["module.model.embed_tokens"]; w = ck["model.layers.0.input_layernorm.weight"]; eps = 1e-6
# RMSNorm: HF recipe in torch vs PaddleFormers recipe in paddle
xt = torch.from_numpy(x); hf_norm = (torch.from_numpy(w) * (xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + eps))).numpy()
xp = paddle.to_tensor(x); var = xp.astype("float32").pow(2).mean(-1, keepdim=True); pd_norm = (paddle.rsqrt(var + eps) * xp * paddle.to_tensor(w)).numpy()
print("input_layernorm recipe, identical input: HF-in-torch vs captured HF", nd(hf_norm, hf["module.model.layers.0.input_layernorm"]))
print("input_layernorm: PaddleFormers recipe vs HF", nd(pd_norm, hf_norm))
vt = xt.pow(2).mean(-1, keepdim=True).numpy(); vp = var.numpy(); print("  variance (mean of squares) torch vs paddle", nd(vt, vp))
rt = torch.rsqrt(torch.from_numpy(vp) + eps).numpy(); rp = paddle.rsqrt(paddle.to_tensor(vp) + eps).numpy(); print("  rsqrt on the same variance", nd(rt, rp))
# Linears on identical input
for mod, inp, wname in [("q_a_proj", "module.model.layers.0.input_layernorm", "model.layers.0.self_attn.q_a_proj.weight"),
                        ("kv_b_proj", "module.model.layers.0.self_attn.kv_a_layernorm", "model.layers.0.self_attn.kv_b_proj.weight"),
                        ("o_proj", "module.model.layers.0.self_attn.core_attention", "model.layers.0.self_attn.o_proj.weight"),
                        ("down_proj", "module.model.layers.0.mlp.act", "model.layers.0.mlp.down_proj.weight")]:
    a, W = hf[inp], ck[wname]
    t = TF.linear(torch.from_numpy(a), torch.from_numpy(W)).numpy()
    p = PF.linear(paddle.to_tensor(a), paddle.to_tensor(np.ascontiguousarray(W.T))).numpy()
    print(f"linear {mod} [T={a.shape[0]}, {W.shape[1]}->{W.shape[0]}]: torch F.linear vs paddle F.linear", nd(t, p))
# SwiGLU: silu(gate)*up
gu = hf["module.model.layers.0.mlp.gate_up_proj"]; g, u = np.split(gu, 2, axis=-1)
st = (TF.silu(torch.from_numpy(g)) * torch.from_numpy(u)).numpy(); sp = (PF.silu(paddle.to_tensor(g)) * paddle.to_tensor(u)).numpy()
print("silu(gate)*up torch vs paddle", nd(st, sp)); print("  silu alone", nd(TF.silu(torch.from_numpy(g)).numpy(), PF.silu(paddle.to_tensor(g)).numpy()))
# softmax fp32
s = np.random.default_rng(0).standard_normal((4, 64, 64)).astype(np.float32)
print("softmax [4,64,64] torch vs paddle", nd(torch.softmax(torch.from_numpy(s), -1).numpy(), PF.softmax(paddle.to_tensor(s), -1).numpy()))
# sigmoid router
lg = np.random.default_rng(1).standard_normal((64, 384)).astype(np.float32)
print("sigmoid [64,384] torch vs paddle", nd(torch.sigmoid(torch.from_numpy(lg)).numpy(), PF.sigmoid(paddle.to_tensor(lg)).numpy()))
# rotary cos/sin fp32
ang = (np.arange(64, dtype=np.float32)[:, None] * (1.0 / (50000 ** (np.arange(0, 16, 2, dtype=np.float32) / 16)))[None]).astype(np.float32)
print("cos torch vs paddle", nd(torch.cos(torch.from_numpy(ang)).numpy(), paddle.cos(paddle.to_tensor(ang)).numpy()), "sin", nd(torch.sin(torch.from_numpy(ang)).numpy(), paddle.sin(paddle.to_tensor(ang)).numpy()))
# CE loss fp32 on identical logits
lo = hf["logits"]; lab = ck["labels"]
lt = TF.cross_entropy(torch.from_numpy(lo), torch.from_numpy(lab), ignore_index=-100).numpy()
ce = paddle.nn.CrossEntropyLoss(reduction="none")(paddle.to_tensor(lo), paddle.to_tensor(lab).unsqueeze(-1)); m = (paddle.to_tensor(lab) != -100).astype("float32")
lp = (paddle.sum(ce.reshape([-1]) * m) / m.sum()).numpy()
print("loss on identical logits torch vs paddle", lt, lp, nd(np.asarray(lt).reshape(1), np.asarray(lp).reshape(1)))
