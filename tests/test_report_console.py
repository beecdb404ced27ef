"""The console summary (harness.report.case_report.console) at a narrow width (issue 40, finding 10): a model's
summary line wrapped so that a line read "BITWISE_PASS (128 not compared); logits DIFF, loss DIFF", like a verdict
(docs/examples/zoo/glm4_moe_2layer_gpu.console.txt, at the 160 columns of a CI log). Wrapped lines stay indented
under their item; the only line that starts with a verdict is the verdict's.

The model summary here is a test double, named as such (``model_summary_double``): the counts of the GLM-4 MoE run
above, hand-built in the shape ``harness.compare.model_outputs.summarise`` gives; it only feeds the renderer."""

import io
import re

import pytest
from rich.console import Console

from harness.compare.result import EXIT_CODES, CaseResult
from harness.report import case_report

VERDICT_AT_START = re.compile(rf"^({'|'.join(EXIT_CODES)})\b")


def model_summary_double() -> dict:
    return {"gradients": {"bitwise_pass": 176, "total": 282, "bitwise_pass_of_idle_experts": 174},
            "module_outputs": {"bitwise_pass": 1, "compared": 25, "not_compared": 128},
            "idle_experts": {"layer 1": 87}, "logits": "DIFF", "loss": "DIFF", "first_divergence": None,
            "not_compared": {}}


@pytest.mark.parametrize("width", [160, 100, 60, 40])
def test_a_wrapped_summary_line_never_starts_like_a_verdict(tmp_path, width):
    result = CaseResult("run", "glm4_moe_2layer", "gpu", verdict="DIFF", message="many tensors differ",
                        model=model_summary_double())
    out = Console(file=io.StringIO(), width=width)
    case_report.console(result, tmp_path, out=out)
    lines = out.file.getvalue().splitlines()
    assert [line for line in lines if VERDICT_AT_START.match(line)] == ["DIFF many tensors differ"], lines
    text = " ".join(" ".join(lines).split())
    assert ("- 176 of 282 canonical gradients BITWISE_PASS (174 of them of the 87 routed experts no token went to: "
            "zero on both sides); 1 of 25 module outputs compared BITWISE_PASS (128 not compared); logits DIFF, loss "
            "DIFF") in text, text
