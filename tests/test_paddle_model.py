"""paddle_model: PaddleFormers' DeepseekV3ForCausalLM on the CPU, the paddlefleet_ops stand-in, UNSUPPORTED paths,
and float64/float32 agreement with HF transformers' DeepseekV3ForCausalLM (torch) on the same HF-named checkpoint.

Every Paddle run is a subprocess (the runner, as the harness starts it); HF's side too
(``python -m tests.support.hf_reference``), because PaddleFormers, once imported, switches transformers' torch
support off.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.support.deepseek_v3_builder import DEFAULT_SHORT_YARN, TINY_SHORT_YARN, numpy_case
from tests.support.installed import absent

ROOT = Path(__file__).resolve().parents[1]
EXIT_UNSUPPORTED = 3

pytestmark = pytest.mark.skipif(absent("paddle", "paddleformers"),
                                reason="paddle_model needs paddlepaddle and paddleformers (requirements-models.txt)")


def run_runner(request: Path, env: dict | None = None) -> tuple[int, dict, Path]:
    import os

    proc = subprocess.run([sys.executable, "-m", "harness.runners.paddle_model", "--request", str(request)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})})
    out = Path(json.loads(request.read_text())["output_dir"])
    assert (out / "meta.json").exists(), proc.stderr[-4000:]
    return proc.returncode, json.loads((out / "meta.json").read_text()), out / "outputs.safetensors"


def load(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def hf_reference(request: Path, out: Path) -> dict[str, np.ndarray]:
    proc = subprocess.run([sys.executable, "-m", "tests.support.hf_reference", str(request), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load(out)


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def expected_names(config: dict, tokens_per_expert: dict[int, int]) -> tuple[set[str], set[str]]:
    """The contract's module and gradient names for a config (experts: those that got tokens)."""
    modules, grads = {"module.model.embed_tokens", "module.model.norm"}, {
        "grad.model.embed_tokens.weight", "grad.model.norm.weight", "grad.lm_head.weight"}
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        modules |= {f"module.{p}", f"module.{p}.input_layernorm", f"module.{p}.post_attention_layernorm",
                    f"module.{p}.self_attn.core_attention"} | {f"module.{p}.self_attn.{a}" for a in attn}
        grads |= {f"grad.{p}.input_layernorm.weight", f"grad.{p}.post_attention_layernorm.weight"} | {
            f"grad.{p}.self_attn.{a}.weight" for a in attn}
        if layer < config["first_k_dense_replace"]:
            modules |= {f"module.{p}.mlp.{m}" for m in ("gate_up_proj", "act", "down_proj")}
            grads |= {f"grad.{p}.mlp.gate_up_proj.weight", f"grad.{p}.mlp.down_proj.weight"}
            continue
        modules |= {f"module.{p}.mlp", f"module.{p}.mlp.shared_experts", f"module.{p}.mlp.gate.topk_indices",
                    f"module.{p}.mlp.gate.probs"} | {f"module.{p}.mlp.experts.{e}" for e in tokens_per_expert}
        grads |= {f"grad.{p}.mlp.gate.weight", f"grad.{p}.mlp.shared_experts.gate_up_proj.weight",
                  f"grad.{p}.mlp.shared_experts.down_proj.weight"}
        grads |= {f"grad.{p}.mlp.experts.{e}.{w}.weight" for e in range(config["n_routed_experts"])
                  for w in ("gate_up_proj", "down_proj")}
    return modules, grads


def test_default_size_fp32_writes_the_contract(tmp_path):
    """Kimi-shaped 2-layer model (384 experts top-8), 64 tokens: 794 gradients, every module, well under a minute."""
    config = DEFAULT_SHORT_YARN
    code, meta, outputs = run_runner(numpy_case(tmp_path, config, 64, "float32"))
    assert code == 0, meta
    tensors = load(outputs)
    indices = tensors["module.model.layers.1.mlp.gate.topk_indices"]
    assert indices.shape == (64, 8) and indices.dtype == np.int64 and (np.diff(indices, axis=1) > 0).all()
    counts = {int(e): int((indices == e).sum()) for e in np.unique(indices)}
    modules, grads = expected_names(config, counts)
    assert {k for k in tensors if k.startswith("grad.")} == grads and len(grads) == 794
    assert {k for k in tensors if k.startswith("module.")} == modules
    for expert, count in counts.items():
        assert tensors[f"module.model.layers.1.mlp.experts.{expert}"].shape == (count, 256)
    probs = tensors["module.model.layers.1.mlp.gate.probs"]
    assert probs.dtype == np.float32 and probs.shape == (64, 384) and ((probs != 0).sum(axis=1) == 8).all()
    np.testing.assert_allclose(probs.sum(axis=1), 2.827, rtol=1e-5)  # normalised, then routed_scaling_factor
    assert tensors["logits"].shape == (64, 2048) and tensors["loss"].shape == ()
    assert tensors["grad.model.layers.1.mlp.experts.0.gate_up_proj.weight"].shape == (64, 256)  # [2F, hidden]
    assert tensors["grad.model.layers.1.mlp.gate.weight"].shape == (384, 256)  # HF [out, in]
    assert meta["not_captured"] == {}
    assert meta["knobs"]["fuse_rms_norm"]["value"] is False
    assert sum(meta["phases"].values()) < 60, meta["phases"]


def test_bf16_on_cpu_is_unsupported_naming_the_kernel(tmp_path):
    code, meta, outputs = run_runner(numpy_case(tmp_path, TINY_SHORT_YARN, 8, "bfloat16"))
    assert code == EXIT_UNSUPPORTED, meta
    assert "matmul (CPU, bfloat16) not registered" in meta["unsupported"]
    assert not outputs.exists()


@pytest.mark.skipif(importlib.util.find_spec("paddlefleet") is not None, reason="paddlefleet is importable here")
def test_gpu_without_paddlefleet_is_unsupported(tmp_path):
    code, meta, _ = run_runner(numpy_case(tmp_path, TINY_SHORT_YARN, 8, "float32", device="gpu"))
    assert code == EXIT_UNSUPPORTED and meta["unsupported"].startswith("paddlefleet is not installed for "), meta


def test_float64_moe_is_unsupported_with_the_reason(tmp_path):
    """PaddleFormers' MoE index_add_s float64 expert outputs into a float32 buffer (the router's dtype): refused."""
    code, meta, outputs = run_runner(numpy_case(tmp_path, TINY_SHORT_YARN, 8, "float64"))
    assert code == EXIT_UNSUPPORTED, meta
    assert "DeepseekV3MoE.moe cannot run in float64" in meta["unsupported"] and not outputs.exists()


# Measured (tiny dense config, 16 tokens): every tensor after the first RMSNorm differs from HF by 5e-8 .. 4.4e-7
# relative; the embedding is bitwise equal and so is the loss. Both implementations compute inside float64 runs in
# float32: RMSNorm (Paddle: variance in float32, then rsqrt(var) * x in float64; HF: the whole normalisation in
# float32, rounded to float32 before the weight), the rotary cos/sin (float32 on both sides), the attention softmax
# (float32 on both), and the loss (logits cast to float32 on both). So the floor is float32's, on every tensor
# from model.layers.0.input_layernorm on, and the test bounds it at 1e-6.
FLOAT64_FLOOR = 1e-6


@pytest.mark.skipif(absent("transformers", "torch"), reason="HF transformers (torch) is the reference")
def test_float64_agrees_with_hf_up_to_the_float32_islands(tmp_path):
    config = {**TINY_SHORT_YARN, "first_k_dense_replace": 2}  # float64 MoE is refused by PaddleFormers (above)
    request = numpy_case(tmp_path / "run", config, 16, "float64")
    code, meta, outputs = run_runner(request)
    assert code == 0, meta
    ours, hf = load(outputs), hf_reference(request, tmp_path / "hf.safetensors")
    assert set(hf) == set(ours)
    assert np.array_equal(ours["module.model.embed_tokens"], hf["module.model.embed_tokens"])
    assert ours["loss"] == hf["loss"]  # both float32 inside (upcast exactly here)
    errors = {name: relative_error(ours[name], hf[name]) for name in hf}
    worst = max(errors, key=errors.get)
    assert errors[worst] < FLOAT64_FLOOR, (worst, errors[worst])
    assert ours["grad.model.layers.0.self_attn.q_a_proj.weight"].dtype == np.float64


@pytest.mark.skipif(absent("transformers", "torch"), reason="HF transformers (torch) is the reference")
def test_float32_moe_matches_hf_routing_and_magnitudes(tmp_path):
    """The MoE layer's name map (router transpose, per-expert weights, probabilities) checked against HF in float32:
    the same experts for every token, every tensor within float32 accumulation-order noise."""
    request = numpy_case(tmp_path / "run", TINY_SHORT_YARN, 16, "float32")
    code, meta, outputs = run_runner(request)
    assert code == 0, meta
    ours, hf = load(outputs), hf_reference(request, tmp_path / "hf.safetensors")
    assert set(hf) <= set(ours) and all(".mlp.experts." in k for k in set(ours) - set(hf))
    assert np.array_equal(ours["module.model.layers.1.mlp.gate.topk_indices"],
                          hf["module.model.layers.1.mlp.gate.topk_indices"])
    errors = {name: relative_error(ours[name], hf[name]) for name in hf}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-5, (worst, errors[worst])


# -- the paddlefleet_ops stand-in ------------------------------------------------------------------------------

def python(code: str, extra_path: Path | None = None) -> dict:
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if extra_path is not None:
        env["PYTHONPATH"] = f"{extra_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("paddlefleet_ops") is not None, reason="the real package is installed")
def test_stand_in_is_installed_only_when_the_real_package_is_missing(tmp_path):
    missing = python("""
        import json, sys
        from harness.runners.paddle import paddlefleet_ops_shim as shim
        adapter = shim.install()
        print(json.dumps({"adapter": adapter, "stand_in": sys.modules["paddlefleet_ops"].__harness_stand_in__}))
    """)
    assert missing["stand_in"] is True and missing["adapter"]["changes_computation"] is False
    real = tmp_path / "site"
    (real / "paddlefleet_ops").mkdir(parents=True)
    (real / "paddlefleet_ops" / "__init__.py").write_text("REAL = True\ndef is_deep_ep_available():\n    return True\n")
    present = python("""
        import json, sys
        from harness.runners.paddle import paddlefleet_ops_shim as shim
        adapter = shim.install()
        import paddlefleet_ops
        print(json.dumps({"adapter": adapter, "real": getattr(paddlefleet_ops, "REAL", False)}))
    """, extra_path=real)
    assert present == {"adapter": None, "real": True}


@pytest.mark.skipif(importlib.util.find_spec("paddlefleet_ops") is not None, reason="the real package is installed")
def test_model_computation_never_touches_the_stand_in(tmp_path):
    """Only PaddleFormers' import asks the stand-in anything (is_deep_ep_available, once); forward and backward
    of the whole model ask nothing. The runner names it in meta.json."""
    request = numpy_case(tmp_path, TINY_SHORT_YARN, 8, "float32")
    result = python(f"""
        import json
        from harness.runners.paddle import paddlefleet_ops_shim as shim
        from harness.runners.paddle import model as paddle_model
        from harness.run.protocol import Phases
        shim.install()
        import paddleformers.transformers.deepseek_v3.modeling  # noqa: F401  (imports fused_a2a)
        after_import = shim.accesses()
        meta = paddle_model.run(json.load(open({str(request)!r})), Phases())
        print(json.dumps({{"after_import": after_import, "after_run": shim.accesses(), "adapters": meta["adapters"]}}))
    """)
    assert result["after_import"] == ["is_deep_ep_available"]
    assert result["after_run"] == result["after_import"]
    assert [a["changes_computation"] for a in result["adapters"]] == [False]
