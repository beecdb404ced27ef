"""PaddleFleet's GPTModel name map (issue 42, item 4; harness/families/glm4_moe/names.toml [paddlefleet], read from
PaddleFleet's and PaddleFormers' public source, never run: PaddleFleet does not install here). What can be checked
without it:

- the section parses, and for the tiny GLM-4.5 every canonical trained parameter has a rule, of the dygraph model's
  kind, reading GPTModel's single-model names: the dygraph names with the embedding under
  ``model.embedding.embed_tokens`` and the head under ``model.lm_head`` (every name under GPTModel's prefix "model");
- ``single_names`` puts a pipeline layer's "{index}.<sublayer>" names in the single-model names its
  ``_pp_to_single_mapping`` gives (a test double of GPTModel's mapping: the harness's renaming only), filling the
  mapping first where it is not yet made, and leaves any other model's names as they are.

That the Paddle recorder reads a model marked ``is_fleet`` through this section is tested with PaddleFormers' real
model in tests/test_attach_paddle.py ("a model marked is_fleet").
"""

import pytest

from harness.case.ops import train_state_names
from harness.families import model_config
from harness.families.names import NameMap
from tests.support.installed import absent
from tests.support.train import TINY_GLM

FLEET_NAMES = {"model.embed_tokens.weight": "model.embedding.embed_tokens.weight",
               "lm_head.weight": "model.lm_head.weight"}  # gpt_embedding.py, gpt_model.py (names.toml cites them)


def rules(section: str) -> dict:
    m = model_config(TINY_GLM)
    name_map = NameMap.load("glm4_moe", section, model=m)
    return {name: name_map.rule("grads", name, m) for name, _ in train_state_names(m)}


def test_every_canonical_parameter_reads_gpt_models_single_names():
    fleet, dygraph = rules("paddlefleet"), rules("paddle")
    assert set(fleet) == set(dygraph) and len(fleet) == 58
    for name, rule in fleet.items():
        assert rule.kind == dygraph[name].kind, name
        assert rule.sources == tuple(FLEET_NAMES.get(s, s) for s in dygraph[name].sources), name
    read = {source for rule in fleet.values() for source in rule.sources}
    assert {"model.embedding.embed_tokens.weight", "model.lm_head.weight",
            "model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.experts.15.up_gate_proj.weight"} <= read
    assert all(source.startswith("model.") for source in read)


@pytest.mark.skipif(absent("paddle"), reason="needs paddle")
def test_single_names_renames_a_pipeline_layers_parameters_only():
    import paddle

    from harness.attach.paddle import single_names

    class PipelineNamesDouble(paddle.nn.Layer):
        """Test double of GPTModel's naming: sublayer "0" and the mapping its _set_pipeline_name_mapping makes."""

        def __init__(self):
            super().__init__()
            self.add_sublayer("0", paddle.nn.Linear(2, 3))
            self._pp_to_single_mapping = None

        def _set_pipeline_name_mapping(self):
            self._pp_to_single_mapping = {"0.weight": "model.lm_head.weight", "0.bias": "model.lm_head.bias"}

    model = PipelineNamesDouble()
    named = single_names(model.named_parameters(), model)
    assert sorted(named) == ["model.lm_head.bias", "model.lm_head.weight"]
    assert named["model.lm_head.weight"] is model._sub_layers["0"].weight
    plain = paddle.nn.Linear(2, 3)
    assert sorted(single_names(plain.named_parameters(), plain)) == ["bias", "weight"]
