"""What a tensor of an op or a model is: its canonical name, shape, role and dtype (``TensorSpec``), shared by the op
records (``harness.case.ops``) and the model families (``harness.families``)."""

from __future__ import annotations

from dataclasses import dataclass, field

# A spec dtype meaning "float32, or float64 in a float64 case" (routing probabilities, the loss, the expert bias).
FLOAT32_OR_WIDER = "float32+"


def resolve_dtype(spec_dtype: str | None, case_dtype: str) -> str:
    """A tensor's dtype name: the spec's own, the case's (None), or float32 widened for a float64 case."""
    if spec_dtype is None:
        return case_dtype
    if spec_dtype == FLOAT32_OR_WIDER:
        return "float64" if case_dtype == "float64" else "float32"
    return spec_dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    # "weight" | "input" | "grad" (an upstream gradient fed to backward) | "ids" | "labels" (derived from the
    # ids: next token, -100 at the end) | "output"
    role: str
    dtype: str | None = None  # None: the case's dtype; else fixed (fp32 router probabilities, int64 ids)
    high: int = 0  # for integer tensors: values are drawn from [0, high)
    # Outputs only: written only when it exists on that side (a routed expert's output exists only when the expert
    # got tokens); a shape dim of -1 depends on the data.
    optional: bool = False
    # Inputs: the distribution when the case states none (else the role's default), e.g. norm weights near 1.
    default_dist: dict | None = field(default=None, compare=False)
