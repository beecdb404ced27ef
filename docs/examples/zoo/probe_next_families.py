"""Which stack here can express Qwen3.5-MoE, DeepSeek-V3.2, DeepSeek-V4 and GLM-5 (issue 34; docs/model.md,
"Families assessed, not added").

Runs on the CPU with the project's venv, in seconds, tiny models only:

    python docs/examples/zoo/probe_next_families.py            # all three stacks, one subprocess each (under a minute)
    python docs/examples/zoo/probe_next_families.py hf         # or one of: hf, megatron, paddle

Prints one JSON line per check. Nothing here is a case: it says what builds and runs, and what stops where.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # the repository, for harness.*


def say(**row):
    print(json.dumps(row, default=str), flush=True)


def failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


# ---------------------------------------------------------------------------------------------------------- HF
def hf():
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    torch.set_num_threads(1)
    for model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "glm_moe_dsa", "deepseek_v32", "deepseek_v4"):
        say(stack=f"transformers {transformers.__version__}", check="model_type registered",
            model_type=model_type, result=model_type in CONFIG_MAPPING_NAMES)

    from transformers import (
        GlmMoeDsaConfig,
        GlmMoeDsaForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next

    hybrid = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  layer_types=["linear_attention", "full_attention"], max_position_embeddings=128)
    dsa = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
               num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
               v_head_dim=16, mlp_layer_types=["dense", "sparse"], index_topk=8, index_head_dim=16, index_n_heads=2,
               max_position_embeddings=128)
    models = [
        ("Qwen3.5-MoE", Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**hybrid),
         {"fast path (fla + causal-conv1d)": modeling_qwen3_5_moe.is_fast_path_available}),
        ("Qwen3-Next", Qwen3NextForCausalLM, Qwen3NextConfig(**hybrid),
         {"fast path (fla + causal-conv1d)": modeling_qwen3_next.is_fast_path_available}),
        ("GLM-5 (glm_moe_dsa)", GlmMoeDsaForCausalLM, GlmMoeDsaConfig(**dsa), {}),
    ]
    tokens = 32
    for family, cls, config, extra in models:
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            model = cls(config).float().train()
            ids = torch.randint(0, config.vocab_size, (1, tokens))
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            params = dict(model.named_parameters())
            no_grad = sorted(name for name, p in params.items() if p.grad is None)
            say(stack=f"transformers {transformers.__version__}", family=family, cls=cls.__name__, dtype="float32",
                tokens=tokens, result="forward+backward ran", loss=round(out.loss.item(), 6),
                parameters=len(params), grads_none=len(no_grad), grads_none_names=no_grad[:6],
                seconds=round(time.perf_counter() - start, 2), **extra)
        except Exception as exc:  # noqa: BLE001 - the probe reports whatever stops it
            say(stack=f"transformers {transformers.__version__}", family=family, cls=cls.__name__,
                result=failure(exc), **extra)

    # DSA: does the indexer's top-k change anything at these sizes? index_topk >= tokens makes it dense MLA.
    losses = {}
    for topk in (8, tokens):
        config = GlmMoeDsaConfig(**{**dsa, "index_topk": topk})
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = GlmMoeDsaForCausalLM(config).float()
        torch.manual_seed(1)
        ids = torch.randint(0, 256, (1, tokens))
        with torch.no_grad():
            losses[topk] = model(input_ids=ids, labels=ids).loss.item()
    say(stack=f"transformers {transformers.__version__}", family="GLM-5 (glm_moe_dsa)",
        check="index_topk 8 vs 32 (dense) at 32 tokens, same weights", losses=losses,
        result="sparse selection changes the loss" if losses[8] != losses[tokens] else "no effect")


# ---------------------------------------------------------------------------------------------------- Megatron
def megatron():
    import importlib.util
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core
    import torch
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.transformer_config import TransformerConfig

    stack = f"megatron-core {megatron.core.__version__}"
    say(stack=stack, check="kernel packages importable", torch=torch.__version__, cuda=torch.version.cuda,
        result={name: importlib.util.find_spec(name) is not None
                for name in ("transformer_engine", "fla", "causal_conv1d", "fast_hadamard_transform", "triton",
                             "tilelang")})
    say(stack=stack, check="LocalSpecProvider has linear() (the DSA indexer spec asks backend.linear())",
        result=hasattr(LocalSpecProvider(), "linear"))
    say(stack=stack, check="LocalSpecProvider.column_parallel_layer_norm_linear() (the GDN in_proj spec)",
        result=LocalSpecProvider().column_parallel_layer_norm_linear())

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                               experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                               linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                               linear_num_value_heads=4, transformer_impl="local")
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    try:
        specs.get_transformer_block_with_experimental_attention_variant_spec(config)
        say(stack=stack, check="experimental block spec, transformer_impl='local'", result="built")
    except Exception as exc:  # noqa: BLE001
        say(stack=stack, check="experimental block spec, transformer_impl='local'", result=failure(exc))

    from megatron.core.ssm import gated_delta_net
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    say(stack=stack, check="megatron.core.ssm.gated_delta_net.HAVE_FLA", result=gated_delta_net.HAVE_FLA)
    try:
        GatedDeltaNet(config, GatedDeltaNetSubmodules(), layer_number=1)
        say(stack=stack, check="GatedDeltaNet(...)", result="built")
    except Exception as exc:  # noqa: BLE001
        say(stack=stack, check="GatedDeltaNet(...)", result=failure(exc))

    from megatron.core.transformer.experimental_attention_variant import dsa
    say(stack=stack, check="dsa: fast_hadamard_transform importable", result=dsa.hadamard_transform is not None)
    for dtype in (torch.float32, torch.bfloat16):
        try:
            dsa.rotate_activation(torch.zeros(4, 16, dtype=dtype))
            say(stack=stack, check=f"dsa.rotate_activation({dtype})", result="ran")
        except Exception as exc:  # noqa: BLE001
            say(stack=stack, check=f"dsa.rotate_activation({dtype})", result=failure(exc))
    say(stack=stack, check="TransformerConfig has dsa_indexer_rotate_activation / dsa_indexer_scoring_relu",
        result=[hasattr(config, "dsa_indexer_rotate_activation"), hasattr(config, "dsa_indexer_scoring_relu")])
    say(stack=stack, check="experimental_attention_variant choices",
        result=str(TransformerConfig.__dataclass_fields__["experimental_attention_variant"].type))


# ------------------------------------------------------------------------------------------------------ Paddle
def paddle_():
    import importlib
    import importlib.util

    sys.path.insert(0, ROOT)
    from harness.runners.paddle import paddlefleet_ops_shim

    paddlefleet_ops_shim.install()
    import paddle
    import paddleformers

    stack = f"paddleformers {paddleformers.__version__}"
    say(stack=stack, check="paddlefleet importable", result=importlib.util.find_spec("paddlefleet") is not None)
    modules = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe": "Qwen3_5MoEForConditionalGeneration",
               "deepseek_v32": "DeepseekV32ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM",
               "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
    from harness.runners.paddle import paddlefleet_shim

    failed = {}
    for name in modules:  # first as installed: no paddlefleet anywhere
        path = f"paddleformers.transformers.{name}.modeling"
        try:
            importlib.import_module(path)
        except Exception as exc:  # noqa: BLE001
            failed[name] = failure(exc)
            cause = exc.__cause__ or exc.__context__
            say(stack=stack, module=path, result=failed[name], cause=failure(cause) if cause else None)
    for name, cls in modules.items():  # then the failed ones with the harness's stand-in (names only, each raises)
        path = f"paddleformers.transformers.{name}.modeling"
        try:
            if name in failed:
                with paddlefleet_shim.standing_in():
                    module = importlib.import_module(path)
            else:
                module = importlib.import_module(path)
        except Exception as exc:  # noqa: BLE001
            cause = exc.__cause__ or exc.__context__
            say(stack=stack, module=path, with_stand_in=True, result=failure(exc),
                cause=failure(cause) if cause else None)
            continue
        say(stack=stack, module=path, with_stand_in=name in failed, result="imports",
            exports=getattr(module, "__all__", None), is_fleet=getattr(getattr(module, cls), "is_fleet", False))

    # The PaddleFleet-only classes: what stops a build here (the stand-in's names raise when called).
    for name, config_name in (("deepseek_v32", "DeepseekV32Config"), ("deepseek_v4", "DeepseekV4Config"),
                              ("glm_moe_dsa", "GlmMoeDsaConfig")):
        try:
            config = getattr(importlib.import_module(f"paddleformers.transformers.{name}.configuration"),
                             config_name)(num_hidden_layers=2)
            getattr(importlib.import_module(f"paddleformers.transformers.{name}.modeling"), modules[name])(config)
            say(stack=stack, family=name, check=f"{modules[name]}(config)", result="built")
        except Exception as exc:  # noqa: BLE001
            say(stack=stack, family=name, check=f"{modules[name]}(config)", result=failure(exc))

    # Qwen3-Next (Qwen3.5's predecessor) is the one dygraph model of these architectures: does a tiny one run?
    try:
        from paddleformers.transformers.qwen3_next.configuration import Qwen3NextConfig
        from paddleformers.transformers.qwen3_next.modeling import Qwen3NextForCausalLM

        paddle.seed(0)
        config = Qwen3NextConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                 linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, intermediate_size=96,
                                 layer_types=["linear_attention", "full_attention"], max_position_embeddings=128,
                                 dtype="float32")
        start = time.perf_counter()
        model = Qwen3NextForCausalLM(config)
        ids = paddle.randint(0, 256, [1, 32])
        out = model(input_ids=ids, labels=ids)
        loss = out[0] if isinstance(out, (tuple, list)) else out.loss
        loss.backward()
        no_grad = [n for n, p in model.named_parameters() if p.grad is None]
        say(stack=stack, family="Qwen3-Next (dygraph)", dtype="float32", tokens=32, result="forward+backward ran",
            loss=round(float(loss), 6), grads_none=len(no_grad), seconds=round(time.perf_counter() - start, 2),
            paddlefleet_stand_in_calls=paddlefleet_shim.calls(),
            fast_path=importlib.import_module("paddleformers.transformers.qwen3_next.modeling").is_fast_path_available)
    except Exception as exc:  # noqa: BLE001
        say(stack=stack, family="Qwen3-Next (dygraph)", result=failure(exc),
            where=traceback.format_exc().strip().splitlines()[-3:])


SECTIONS = {"hf": hf, "megatron": megatron, "paddle": paddle_}

if __name__ == "__main__":
    if len(sys.argv) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        SECTIONS[sys.argv[1]]()
    else:
        for section in SECTIONS:  # the libraries' warnings and logs are shown only when a section fails
            done = subprocess.run([sys.executable, __file__, section], check=False, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"})
            if done.returncode:
                sys.stderr.write(done.stderr)
                say(section=section, result=f"exit {done.returncode}")
