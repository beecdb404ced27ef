"""harness.capture.paddle on a two-linear Paddle model: hooks, name-map rules, gradients, the written file."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.support.installed import absent

pytestmark = pytest.mark.skipif(absent("paddle"), reason="needs paddlepaddle (on CI: never skipped)")


class Rules:
    """A name map with the shape of harness.families.names.NameMap: rule(section, name) -> kind, sources, index, why."""

    def __init__(self, table):
        self.table = table

    def rule(self, section, name):
        kind, sources = self.table.get((section, name), ("same", (name,)))
        return SimpleNamespace(kind=kind, sources=tuple(sources), index=None,
                               why=sources if kind == "not_captured" else "")


def build():
    import paddle

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.gate_proj = paddle.nn.Linear(4, 3, bias_attr=False)
            self.up_proj = paddle.nn.Linear(4, 3, bias_attr=False)
            self.down_proj = paddle.nn.Linear(3, 4, bias_attr=False)
            self.unused = paddle.nn.Linear(4, 4, bias_attr=False)

        def forward(self, x):
            return self.down_proj(paddle.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    paddle.seed(1)
    return Block(), paddle.randn([1, 5, 4])


def test_rules_hooks_gradients_and_file(tmp_path):
    from safetensors.numpy import load_file

    from harness.capture.paddle import capture

    model, x = build()
    rules = Rules({
        ("modules", "gate_up"): ("cat_last", ["gate_proj", "up_proj"]),
        ("modules", "act"): ("input_of", ["down_proj"]),
        ("modules", "hidden"): ("not_captured", "fused away"),
        ("grads", "gate_up_proj.weight"): ("transpose_cat0", ["gate_proj.weight", "up_proj.weight"]),
        ("grads", "down_proj.weight"): ("transpose", ["down_proj.weight"]),
    })
    path = tmp_path / "step.safetensors"
    with capture(model, path, name_map=rules, modules=["gate_up", "act", "down_proj", "hidden", "unused"],
                 grads=["gate_up_proj.weight", "down_proj.weight", "unused.weight"]) as cap:
        out = model(x)
        out.sum().backward()
        cap.record("out", out[0])
    gate = model.gate_proj(x).numpy()[0]
    up = model.up_proj(x).numpy()[0]
    tensors = load_file(str(path))
    assert np.array_equal(tensors["module.gate_up"], np.concatenate([gate, up], axis=-1))  # [5, 6]: batch dropped
    act = tensors["module.act"]
    assert act.shape == (5, 3) and np.array_equal(tensors["module.down_proj"], tensors["out"])
    assert np.array_equal(tensors["grad.gate_up_proj.weight"],
                          np.concatenate([model.gate_proj.weight.grad.numpy().T, model.up_proj.weight.grad.numpy().T]))
    assert tensors["grad.down_proj.weight"].shape == (4, 3)  # [out, in]
    assert np.array_equal(tensors["grad.unused.weight"], np.zeros((4, 4), np.float32))
    assert cap.zero_grads == ["unused.weight"]
    assert cap.not_captured == {"module.hidden": "fused away", "module.unused": "sublayer 'unused' did not run"}


def test_two_dimensional_outputs_keep_a_single_row():
    """An expert that got one token gives [1, hidden]: one token, not a batch dim; [1, T, H] loses its batch dim."""
    import paddle

    from harness.capture.paddle import capture

    model, x = build()
    with capture(model, None, modules=["gate_proj", "down_proj"], grads=[]) as cap:
        model.gate_proj(x[0, :1])  # [1, 4] -> [1, 3]
        model.down_proj(paddle.ones([1, 5, 3]))
    assert cap.tensors["module.gate_proj"].shape == (1, 3)
    assert cap.tensors["module.down_proj"].shape == (5, 4)
