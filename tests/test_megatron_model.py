"""The megatron_model runner (Megatron-Core GPTModel, MLA + MoE, local spec) against HF transformers'
DeepseekV3ForCausalLM on the same HF-named checkpoint, and each of its adapters.

The float64 proof: with HF's own float32 islands lifted and Megatron's forced float32 islands (sigmoid of the router
logits, the RoPE table, the float32 cross entropy) imitated on the HF side or avoided on the Megatron side
(`loss_path="float64_logits"`), every canonical tensor agrees to ~1e-15: the name map, the layouts, the RoPE
convention, the routing and the loss masking are right. The plain runner (Megatron's own float32 cross entropy and
sigmoid) is then measured against HF lifted to float64: those islands are the floor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.installed import require

# In-process tests build Megatron modules too: eager numerics as in the runner (whose own setdefault comes too late
# once torch is imported here). Seen on the H200 host: without it, torch.compile of Megatron's swiglu fails there.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
torch = require("torch")
require("megatron.core")
require("transformers")

from harness.run.protocol import Phases  # noqa: E402
from tests.support.deepseek_v3_builder import DEFAULT, TINY, hf_init_case  # noqa: E402
from tests.support.doubles import broken_install_python, missing_package_python  # noqa: E402
from tests.support.hf_reference import group_of, lift_hf_fp32_islands, relative_error, run_hf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def expected_grad_count(model: dict) -> int:
    dense, layers = model["first_k_dense_replace"], model["num_hidden_layers"]
    return 1 + 11 * dense + (12 + 2 * model["n_routed_experts"]) * (layers - dense) + 2


@pytest.fixture(scope="module")
def megatron_in_process():
    from harness.runners.megatron import model as megatron_model

    megatron_model.init_process_group(torch.device("cpu"))
    return megatron_model


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    return hf_init_case(tmp_path_factory.mktemp("tiny64"), TINY, "float64", 16)


def compare(ours: dict, ref: dict) -> dict[str, tuple[float, str]]:
    """Worst normwise relative error per tensor group, over the names both sides have."""
    groups: dict[str, tuple[float, str]] = {}
    for name, expected in ref.items():
        assert ours[name].shape == expected.shape, name
        error = relative_error(ours[name], expected)
        group = group_of(name)
        if error >= groups.get(group, (-1.0, ""))[0]:
            groups[group] = (error, name)
    return groups


def report(title, groups):
    print(f"\n{title}")
    for group, (error, name) in sorted(groups.items()):
        print(f"  {group:26s} {error:.3e}  ({name})")


# DeepSeek-V3's group-limited routing (n_group 8, topk_group 4, top-8: each group scored by its top-2) in small.
GROUPED = dict(TINY, n_group=4, topk_group=1, num_experts_per_tok=2)


@pytest.mark.parametrize("model", [TINY, GROUPED], ids=["tiny", "group_limited_routing"])
def test_float64_mapping_matches_hf(megatron_in_process, tiny64, model, tmp_path):
    """Every canonical tensor, with Megatron's float32 islands matched on both sides: ~1e-15."""
    request, net, input_ids, labels = tiny64 if model is TINY else hf_init_case(tmp_path, model, "float64", 16)
    ours, meta, _ = megatron_in_process.compute(request, Phases(), loss_path="float64_logits")
    net.zero_grad()
    with lift_hf_fp32_islands(megatron_islands=True):
        ref = run_hf(net, input_ids, labels, model)
    experts = {n for n in ref if ".mlp.experts." in n and n.startswith("module.")}
    assert not experts  # HF has no per-expert hook point either; Megatron's side is in not_captured
    assert set(ref) == set(ours), (sorted(set(ref) - set(ours)), sorted(set(ours) - set(ref)))
    assert sum(n.startswith("grad.") for n in ours) == expected_grad_count(TINY) == meta["parameter_gradients"]
    groups = compare(ours, ref)
    report("float64, islands matched: max |a-b|/max|b| per group", groups)
    assert max(e for e, _ in groups.values()) < 1e-12, groups
    assert torch.equal(ours["module.model.layers.1.mlp.gate.topk_indices"],
                       ref["module.model.layers.1.mlp.gate.topk_indices"])


def test_float64_runner_floor_against_hf(megatron_in_process, tiny64):
    """The runner as it runs (Megatron's float32 sigmoid in the router, float32 cross entropy) against HF with its
    float32 islands lifted (HF's loss in float32 too, as HF's own loss path upcasts to float32): the floors."""
    request, net, input_ids, labels = tiny64
    ours, meta, _ = megatron_in_process.compute(request, Phases())
    assert ours["loss"].dtype == torch.float64
    net.zero_grad()
    with lift_hf_fp32_islands(megatron_islands=False):
        ref = run_hf(net, input_ids, labels, TINY, loss_dtype=torch.float32)
    groups = compare(ours, ref)
    report("float64, the runner vs HF lifted to float64 (floors)", groups)
    before_router = [n for n in ref if n.startswith("module.") and (".layers.0" in n or "self_attn" in n
                                                                      or "layernorm" in n or "shared_experts" in n)]
    assert max(relative_error(ours[n], ref[n]) for n in before_router) < 1e-12  # float64 up to the router
    assert groups["module:mlp.gate."][0] < 1e-6  # sigmoid(logits.float()): one float32 rounding
    assert max(e for g, (e, _) in groups.items() if g.startswith("grad:")) < 1e-6  # float32 cross entropy
    assert torch.equal(ours["module.model.layers.1.mlp.gate.topk_indices"],
                       ref["module.model.layers.1.mlp.gate.topk_indices"])
    assert set(meta["not_captured"]) == {f"model.layers.1.mlp.experts.{e}" for e in range(TINY["n_routed_experts"])}


def test_mla_attention_adapter_computes_mla_attention(megatron_in_process):
    """MLADotProductAttention with qk head dim 24 != v head dim 12: causal softmax(q k^T * scale) v in float64,
    output [s, b, heads * v]."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from harness.runners.megatron.blocks import MLADotProductAttention

    mm = megatron_in_process
    mm.install_adapters(torch.device("cpu"), TINY)
    heads, dqk, dv, s = 4, 24, 12, 9
    config = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=heads, q_lora_rank=16,
                                  kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=dv,
                                  params_dtype=torch.float64, attention_dropout=0.0, masked_softmax_fusion=False,
                                  use_cpu_initialization=True, perform_initialization=False)
    scale = 0.37
    attention = MLADotProductAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                       attention_type="self", softmax_scale=scale, k_channels=dqk, v_channels=dv)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(s, 1, heads, dqk, generator=g, dtype=torch.float64), torch.randn(s, 1, heads, dqk, generator=g,
                                                                                         dtype=torch.float64)
    v = torch.randn(s, 1, heads, dv, generator=g, dtype=torch.float64)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    out = attention(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    scores = torch.einsum("qhd,khd->hqk", q[:, 0], k[:, 0]) * scale
    probs = torch.softmax(scores.masked_fill(mask[0], float("-inf")), dim=-1)
    expected = torch.einsum("hqk,khd->qhd", probs, v[:, 0]).reshape(s, 1, heads * dv)
    assert out.shape == (s, 1, heads * dv)
    assert relative_error(out, expected) < 1e-14


ABLATION = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from tests.support.deepseek_v3_builder import TINY, hf_init_case
    from harness.runners.megatron import model as mm
    from harness.run.protocol import Phases
    request, *_ = hf_init_case(Path(sys.argv[2]), TINY, "float32", 8)
    mm.init_process_group(torch.device("cpu"))
    try:
        mm.compute(request, Phases(), skip_adapters=(sys.argv[1],))
    except Exception as error:
        print("FAILED-WITHOUT-ADAPTER", type(error).__name__, str(error)[:300])
    else:
        print("RAN-WITHOUT-ADAPTER")
""")


@pytest.mark.parametrize("adapter, error", [
    ("MLADotProductAttention", "unexpected keyword argument 'k_channels'"),
    ("mla_have_te_false", "isinstance() arg 2 must be a type"),
    ("cpu_current_device", "Torch not compiled with CUDA enabled"),
    ("cpu_rng_tracker", "cuda rng state model-parallel-rng is not added"),
    ("te_general_gemm_none", "name 'te_general_gemm' is not defined"),
])
def test_each_adapter_is_needed(adapter, error, tmp_path):
    """Without the adapter the model does not build or run on this CPU-only torch (so a removed adapter fails here);
    with all of them the float64 tests above prove they change no computation."""
    from megatron.core import __version__ as megatron_version
    from megatron.core.transformer import multi_latent_attention
    from packaging.version import Version

    from harness.runners.megatron.model import te_importable

    if adapter in ("mla_have_te_false", "te_general_gemm_none") and te_importable():
        pytest.skip("Transformer Engine is installed: the shim is not applied")
    if adapter == "mla_have_te_false" and (multi_latent_attention.TELinear is None
                                           or isinstance(multi_latent_attention.TELinear, type)):
        pytest.skip("this megatron-core takes HAVE_TE from the real import (0.19 does): no MagicMock TELinear")
    if adapter == "te_general_gemm_none" and Version(megatron_version) >= Version("0.17"):
        pytest.skip("megatron-core >= 0.17 defines te_general_gemm itself (read in 0.19 source)")
    if adapter.startswith("cpu_") and torch.cuda.is_available():
        pytest.skip("CPU-only shims")
    done = subprocess.run([sys.executable, "-c", ABLATION, adapter, str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert "FAILED-WITHOUT-ADAPTER" in done.stdout, done.stdout + done.stderr[-3000:]
    assert error in done.stdout, done.stdout


def test_runner_default_size_writes_the_contract(tmp_path):
    """`python -m harness.runners.megatron_model` at the default size (384 experts top-8, 64 tokens, fp32): exit 0,
    794 gradients, every contract module output except the routed experts (listed in not_captured), adapters named."""
    request, _, _, labels = hf_init_case(tmp_path, DEFAULT, "float32", 64)
    done = subprocess.run([sys.executable, "-m", "harness.runners.megatron_model", "--request",
                           str(tmp_path / "request.json")], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors.torch import load_file

    out = load_file(str(tmp_path / "out" / "outputs.safetensors"))
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    grads = [n for n in out if n.startswith("grad.")]
    assert len(grads) == 794 == expected_grad_count(DEFAULT)
    assert out["loss"].dtype == torch.float32 and out["logits"].shape == (64, DEFAULT["vocab_size"])
    assert out["module.model.layers.1.mlp.gate.topk_indices"].shape == (64, 8)
    # The logits as the output layer produced them (fp32 cross entropy works in place on them: captured as a copy)
    ce = torch.nn.functional.cross_entropy(out["logits"], labels, ignore_index=-100)
    assert abs(ce.item() - out["loss"].item()) < 1e-5 * out["loss"].item()
    assert out["module.model.layers.1.mlp.gate.probs"].dtype == torch.float32
    assert len(meta["not_captured"]) == 384
    assert {a["name"] for a in meta["adapters"]} >= {"MLADotProductAttention", "cpu_current_device"}
    assert all(a["changes_computation"] is False for a in meta["adapters"])
    print("\nphases (s):", meta["phases"])


def _run_without_megatron(tmp_path, python):
    request = {"case": "x", "op": "causal_lm", "dtype": "float32", "device": "cpu", "tp": 1, "tokens": 4,
               "config": {"model": TINY}, "checkpoint": "none", "output_dir": str(tmp_path / "out")}
    (tmp_path / "request.json").write_text(json.dumps(request))
    return subprocess.run([python, "-m", "harness.runners.megatron_model", "--request", str(tmp_path / "request.json")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_megatron_not_installed_is_unsupported(tmp_path):
    """megatron not installed (a test double hides it) -> exit 3, meta.json naming the package."""
    done = _run_without_megatron(tmp_path, missing_package_python(tmp_path, "megatron"))
    assert done.returncode == 3, done.stderr[-2000:]
    unsupported = json.loads((tmp_path / "out" / "meta.json").read_text())["unsupported"]
    assert unsupported.startswith("megatron.core is not installed for ") and "hidden by a test double" in unsupported


def test_megatron_installed_but_broken_is_an_error_with_its_traceback(tmp_path):
    """megatron installed but missing a dependency of its own -> a crash (ERROR), never UNSUPPORTED: the old runner
    said UNSUPPORTED for any ImportError."""
    done = _run_without_megatron(tmp_path, broken_install_python(tmp_path, "megatron"))
    assert done.returncode == 1 and not (tmp_path / "out" / "meta.json").exists(), done.stderr[-2000:]
    assert "BrokenInstall: megatron.core is installed for " in done.stderr
    assert "No module named 'megatron_test_double_missing_dependency'" in done.stderr
    assert "Traceback" in done.stderr


def test_one_rank_process_groups_take_no_port():
    """A single-rank cell rendezvouses in its own process (a HashStore), not over TCP: a port picked free and bound a
    moment later was taken by another of 14 cells running at once on the H100 (EADDRINUSE, an ERROR cell). In a
    process of its own: a test before it in this one may have left a process group."""
    code = textwrap.dedent("""
        import torch, torch.distributed as dist
        from harness.runners.megatron.runner import init_process_group, reset
        init_process_group(torch.device("cpu"))
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        print(type(store).__name__)
        reset()
    """)
    done = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "HashStore", done.stdout
