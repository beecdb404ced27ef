"""Did a run do what its case says (``expect`` in the case file)? The rules, for a run's comparisons and, through
``exactness_problems``, for a baseline record (harness.baselines.records)."""

from __future__ import annotations

from harness.compare.tensors import DIFF, EQUAL, TensorComparison

BITWISE_PASS, WITHIN_TOLERANCE = "BITWISE_PASS", "WITHIN_TOLERANCE"


def check_expectation(expect, verdict: str, tensors: list[TensorComparison], departures: list[str] = ()) -> dict:
    """Did the run do what the case says it should? Lists each way it did not. `departures`: the sides' ranks that
    ended with other state than their rank 0 (harness.compare.result.rank_departures). A case that states nothing
    is met by a bitwise pass only (a DIFF still exits 1) and lists no verdict problem (it expected none: its verdict
    says the rest); its ranks must still agree."""
    status = {t.name: t.status for t in tensors}
    problems = []
    bitwise_within_tolerance = expect.verdict == WITHIN_TOLERANCE and verdict == BITWISE_PASS  # 0 ULP is within
    missed = verdict != expect.verdict and not bitwise_within_tolerance
    if missed and expect.stated:
        problems.append(f"verdict {verdict}, expected {expect.verdict}")
    problems += [f"{n} was expected to differ but is {status.get(n, 'absent')}" for n in expect.differs
                 if status.get(n) != DIFF]
    problems += [f"{n} was expected to be bitwise equal but is {status.get(n, 'absent')}" for n in expect.equal
                 if status.get(n) != EQUAL]
    problems += exactness_problems(expect.only_differ, expect.bitwise_steps, status)
    if departures and expect.ranks_agree:
        problems += [f"ranks were expected to agree: {line}" for line in departures]
    if not departures and not expect.ranks_agree:
        problems.append("a side's ranks were expected to end a step with other state than its rank 0 "
                        "(expect.ranks_agree = false); every rank agreed with rank 0")
    return {**_stated(expect), "met": not missed and not problems, "problems": problems}


def _stated(expect) -> dict:
    return {"verdict": expect.verdict, "differs": list(expect.differs), "equal": list(expect.equal),
            "only_differ": None if expect.only_differ is None else list(expect.only_differ),
            "bitwise_steps": list(expect.bitwise_steps), "ranks_agree": expect.ranks_agree, "stated": expect.stated}


def exactness_problems(only_differ, bitwise_steps, status: dict[str, str]) -> list[str]:
    """What breaks `only_differ` (exactly these tensors differ, within the steps they name) and `bitwise_steps`;
    `status`: tensor -> status, EQUAL or not (a baseline record lists only the tensors that are not)."""
    problems = []
    if only_differ is not None:
        listed = set(only_differ)
        steps = {step_of(n) for n in listed}
        problems += [f"{n} was expected to differ but is {status.get(n, EQUAL)}" for n in only_differ
                     if status.get(n, EQUAL) != DIFF]
        beyond = [n for n, s in status.items() if s != EQUAL and n not in listed and
                  (None in steps or step_of(n) in steps)]
        if beyond:
            where = "" if None in steps else f" at step {', '.join(map(str, sorted(steps)))}"
            problems.append(f"only {', '.join(only_differ)} were expected to differ{where}; "
                            f"{len(beyond)} more do: {', '.join(beyond[:5])}{' ...' if len(beyond) > 5 else ''}")
    for step in bitwise_steps:
        differing = [n for n, s in status.items() if s != EQUAL and step_of(n) == step]
        if differing:
            problems.append(f"step {step} was expected bitwise equal; {len(differing)} tensors differ: "
                            f"{', '.join(differing[:5])}{' ...' if len(differing) > 5 else ''}")
    return problems


def step_of(name: str) -> int | None:
    """The training step a tensor belongs to (step3.param.x -> 3), None for an op's or a model's output."""
    head = name.split(".", 1)[0]
    return int(head[4:]) if head.startswith("step") and head[4:].isdigit() else None
