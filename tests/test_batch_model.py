"""``--versus batch``, ``pad`` and ``cache`` on a model case: its sequence alone against the same sequence first in
batches of M others, right-padded beside another, or computed chunk by chunk through HF's KV cache.

The harness's own logic (side b's sequences, labels and mask, cutting the first sequence out of a batch in each
stack's layout, the refusals) on a tiny DeepSeek-V3 model; one planted batch-dependent module in real HF transformers
(a test double named as such, ``planted_batch_embedding``) that the command must find at that module and that M; and
one planted cache fault (``planted_cache_fault``) that the cache comparison must find from the second chunk on. What
a real stack gives across M, padding or chunks depends on the CPU (docs/batch-invariance.md): only the gather's
exactness is pinned.
"""

import numpy as np
import pytest
import torch

from harness import CompareOptions, Versus, compare_case
from harness.capture.rows import EXPERT_BATCH_WHY, first_sequence, first_sequence_only
from harness.case import batch
from harness.case.checkpoints import load_tensors, prepare
from harness.case.registry import CaseError, Registry
from harness.commands import batch_sweep
from tests.support.cases import tiny_case, write_cases
from tests.support.doubles import python_with_startup

TOKENS = 4
MODEL = tiny_case("tiny_lm", family="model", op="causal_lm", dtype="float32", tokens=TOKENS, shapes=None,
                  runners=["hf_model", "hf_model"], tensors=None, devices=["cpu"],
                  config={"model": {"family": "deepseek_v3", "num_hidden_layers": 2, "first_k_dense_replace": 1,
                                    "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
                                    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                                    "qk_rope_head_dim": 8, "v_head_dim": 8, "intermediate_size": 64,
                                    "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                    "vocab_size": 64}})


def planted_batch_embedding(folder):
    """Test double: this interpreter with torch's embedding planted to move the first sequence's first element by
    0.5 once the batch holds more than one sequence besides it (M > 1): a batch-dependent module, the model's first."""
    return python_with_startup(folder, "planted_batch_embedding", """
        import torch
        original = torch.nn.functional.embedding
        def embedding(ids, *args, **kwargs):
            out = original(ids, *args, **kwargs)
            if ids.dim() == 2 and ids.shape[0] > 2:
                bump = torch.zeros_like(out)
                bump[0, 0, 0] = 0.5
                out = out + bump
            return out
        torch.nn.functional.embedding = embedding
    """)


def planted_cache_fault(folder):
    """Test double: this interpreter with HF's DynamicCache planted to hand back layer 0's keys off by 100 at their
    first element once it holds an earlier pass's: a fault only a pass through the cache reads."""
    return python_with_startup(folder, "planted_cache_fault", """
        import transformers
        original = transformers.DynamicCache.update
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            held = self.get_seq_length(layer_idx)
            keys, values = original(self, key_states, value_states, layer_idx, *args, **kwargs)
            if layer_idx == 0 and held:
                keys = keys.clone()
                keys[..., 0, 0] += 100.0
            return keys, values
        transformers.DynamicCache.update = update
    """)


@pytest.fixture
def case(tmp_path):
    return Registry.load(write_cases(tmp_path, MODEL)).get("tiny_lm")


def test_the_first_sequence_is_cut_out_of_each_stacks_layout():
    batch_first = torch.arange(3 * 4 * 2).view(3, 4, 2)  # [b, s, h]: HF, PaddleFormers
    assert torch.equal(first_sequence(batch_first, 3, 4, sequence_first=False), batch_first[0])
    assert torch.equal(first_sequence(batch_first.view(12, 2), 3, 4, sequence_first=False), batch_first[0])
    sequence_first = batch_first.transpose(0, 1).contiguous()  # [s, b, h]: Megatron
    assert torch.equal(first_sequence(sequence_first, 3, 4, sequence_first=True), batch_first[0])
    assert torch.equal(first_sequence(sequence_first.view(12, 2), 3, 4, sequence_first=True), batch_first[0])
    assert first_sequence(batch_first, 1, 12, sequence_first=False) is batch_first  # alone: as it is
    with pytest.raises(ValueError, match=r"shape \[5, 2\] has no dims of 3 sequences of 4 tokens \(batch first\)"):
        first_sequence(torch.zeros(5, 2), 3, 4, sequence_first=False)


def test_a_routed_experts_output_mixes_the_sequences_and_is_dropped_with_why():
    tensors = {"module.model.layers.1.mlp.experts.3": np.zeros((5, 2)), "module.model.norm": np.ones((2, 4, 2)),
               "grad.lm_head.weight": np.ones((8, 2)), "logits": np.ones((4, 8))}
    assert first_sequence_only(tensors, 2, 4, sequence_first=False) == {"model.layers.1.mlp.experts.3":
                                                                         EXPERT_BATCH_WHY}
    assert set(tensors) == {"module.model.norm", "grad.lm_head.weight", "logits"}
    assert tensors["module.model.norm"].shape == (4, 2) and tensors["grad.lm_head.weight"].shape == (8, 2)


def test_side_b_holds_the_sequence_first_then_others_whose_labels_are_all_ignored(case, tmp_path):
    checkpoint = prepare(case, tmp_path / "ck")
    alone, batched = load_tensors(checkpoint.path), load_tensors(batch.write_sequences(case, 3, checkpoint, tmp_path))
    assert batched["input_ids"].shape == batched["labels"].shape == (4, TOKENS)
    assert np.array_equal(batched["input_ids"][0], alone["input_ids"])
    assert np.array_equal(batched["labels"][0], alone["labels"])
    assert (batched["labels"][1:] == batch.IGNORE).all()  # their loss weight is zero
    assert len({tuple(row) for row in batched["input_ids"]}) == 4  # other sequences of their own


@pytest.mark.parametrize("versus, refeed, problem", [
    (Versus("batch", 2, "megatron"), False, "--runner must be one of hf_model, megatron_model, paddle_model"),
    (Versus("pad", 2, "paddle_model"), False, "--runner must be one of hf_model, megatron_model (got"),
    (Versus("batch", 2), True, "--refeed re-runs side b's modules from side a's tensors; with --versus batch"),
    (Versus("tp", 2), False, "--versus tp: model-level cases take --versus batch, pad, cache"),
])
def test_what_the_model_level_cannot_batch_is_refused_before_any_runner_starts(tmp_path, versus, refeed, problem):
    result, _ = compare_case("tiny_lm", CompareOptions(
        reports_dir=tmp_path / "reports", cases_dir=write_cases(tmp_path, MODEL), checkpoints_dir=tmp_path / "ck",
        oracle=False, refeed_ops=refeed, versus=versus))
    assert result.verdict == "ERROR" and problem in result.message, result.message


def test_a_one_token_sequence_is_refused(case):
    with pytest.raises(CaseError, match="needs at least 2 tokens"):
        batch.check_model(case.with_tokens(1), 1)


def test_padded_side_b_masks_and_ignores_the_pads_beside_one_other_sequence(case, tmp_path):
    checkpoint = prepare(case, tmp_path / "ck")
    alone, padded = load_tensors(checkpoint.path), load_tensors(batch.write_padded(case, 3, checkpoint, tmp_path))
    assert padded["input_ids"].shape == padded["labels"].shape == padded["attention_mask"].shape == (2, TOKENS + 3)
    assert np.array_equal(padded["input_ids"][0], [*alone["input_ids"], 0, 0, 0])
    assert np.array_equal(padded["labels"][0], [*alone["labels"], -100, -100, -100])
    assert padded["attention_mask"].tolist() == [[1] * TOKENS + [0] * 3, [1] * (TOKENS + 3)]
    assert (padded["labels"][1] == batch.IGNORE).all()
    with pytest.raises(CaseError, match="--versus pad expects a count of padding tokens of at least 1"):
        batch.write_padded(case, 0, checkpoint, tmp_path)


@pytest.mark.parametrize("chunk", [0, TOKENS])
def test_a_cache_chunk_must_split_the_sequence(case, chunk):
    with pytest.raises(CaseError, match=f"--versus cache expects a chunk of 1 to {TOKENS - 1} tokens"):
        batch.check_chunk(case, chunk)


def test_only_hf_runs_through_a_kv_cache(tmp_path):
    result, _ = compare_case("tiny_lm", CompareOptions(
        reports_dir=tmp_path / "reports", cases_dir=write_cases(tmp_path, MODEL), checkpoints_dir=tmp_path / "ck",
        oracle=False, versus=Versus("cache", 2, "megatron_model")))
    assert result.verdict == "ERROR" and "--runner must be one of hf_model (got 'megatron_model')" in result.message


@pytest.mark.e2e
@pytest.mark.slow  # 18 s on the shared 2-core machine (35 s beside a sweep): four HF runs
def test_a_planted_batch_dependent_module_is_found_at_that_module_and_that_m(tmp_path):
    """Real HF transformers DeepSeek-V3 (fp32) with torch's embedding planted to depend on the batch from M=2."""
    options = CompareOptions(reports_dir=tmp_path / "reports", cases_dir=write_cases(tmp_path, MODEL),
                             checkpoints_dir=tmp_path / "ck", oracle=False,
                             pythons={"hf_model": planted_batch_embedding(tmp_path)})
    report, folder = batch_sweep.run("tiny_lm", [1, 2], None, options)

    first, second = report["cells"]
    assert report["unit"] == "sequence" and second["verdict"] == "DIFF" and report["exit_code"] == 1
    # a gather keeps every row's bits on any CPU: at M=1 the embedding holds; what follows is the CPU's
    assert first["tensors"]["module.model.embed_tokens"]["status"] == "EQUAL"
    assert second["first_divergence"] == "module.model.embed_tokens"
    planted = second["tensors"]["module.model.embed_tokens"]
    assert planted["mismatches"] == 1 and planted["first_mismatch"]["index"] == [0, 0]
    assert report["summary"]["first_differs"]["module.model.embed_tokens"] == 2
    assert "module.model.layers.1.mlp.experts.0" not in second["tensors"]  # a routed expert's: not one sequence's
    assert "module.model.embed_tokens" in (folder / "report.md").read_text()


@pytest.mark.e2e
@pytest.mark.slow  # 12 s on the shared 2-core machine: two HF runs
def test_a_planted_cache_fault_is_found_in_the_logits_from_the_second_pass_on(tmp_path):
    """Real HF transformers DeepSeek-V3 (fp32), two tokens a pass, with the cache planted to return a key off."""
    result, run_dir = compare_case("tiny_lm", CompareOptions(
        reports_dir=tmp_path / "reports", cases_dir=write_cases(tmp_path, MODEL), checkpoints_dir=tmp_path / "ck",
        oracle=False, versus=Versus("cache", 2), pythons={"hf_model": planted_cache_fault(tmp_path)}))

    assert result.verdict == "DIFF" and [t.name for t in result.tensors] == ["logits", "loss"], result.message
    b = next(side for side in result.sides if side.label == "b")
    assert b.meta["kv_cache"] == {"chunk": 2, "passes": 2}
    alone, cached = (load_tensors(side.outputs)["logits"] for side in result.sides[:2])
    off = np.abs(alone - cached).max(axis=1)  # per token: rounding moves these logits by about 1e-8, the fault by more
    assert (off[:2] < 1e-6).all() and (off[2:] > 1e-4).all(), off
