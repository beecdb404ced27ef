"""float64: Paddle and torch kernels on identical float64 inputs, and the RMSNorm float32 island of both models.

    python docs/examples/paddle-model/f64_recipes.py
"""
import numpy as np, torch, paddle
import torch.nn.functional as TF, paddle.nn.functional as PF
rng = np.random.default_rng(0)
def rel(a, b): return float(np.abs(a - b).max() / np.abs(b).max())
x = rng.standard_normal((16, 64)); W = rng.standard_normal((48, 64)) * 0.02; w = 1 + 0.1 * rng.standard_normal(64)
print("f64 linear torch vs paddle", rel(TF.linear(torch.from_numpy(x), torch.from_numpy(W)).numpy(), PF.linear(paddle.to_tensor(x), paddle.to_tensor(W.T.copy())).numpy()))
print("f64 silu*up", rel((TF.silu(torch.from_numpy(x)) * torch.from_numpy(x)).numpy(), (PF.silu(paddle.to_tensor(x)) * paddle.to_tensor(x)).numpy()))
s = rng.standard_normal((4, 16, 16))
print("f64 softmax", rel(torch.softmax(torch.from_numpy(s), -1).numpy(), PF.softmax(paddle.to_tensor(s), -1).numpy()))
# RMSNorm recipes in a float64 run
xt = torch.from_numpy(x); x32 = xt.to(torch.float32)
hf = (torch.from_numpy(w) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.float64)).numpy()
xp = paddle.to_tensor(x); var = xp.astype("float32").pow(2).mean(-1, keepdim=True)
pd = (paddle.rsqrt(var + 1e-6) * xp * paddle.to_tensor(w)).numpy()
exact = w * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
print("f64 run RMSNorm: PaddleFormers vs HF", rel(pd, hf), " PaddleFormers vs exact", rel(pd, exact), " HF vs exact", rel(hf, exact))
