"""The head of a run's report: verdict, expectation, how tensor parallelism was launched and gathered, the
case and its checkpoint. Everything a reader needs before the tables, as one list."""

from __future__ import annotations

from harness.report.blocks import h, ul


def blocks(data: dict, figures: dict) -> list[tuple]:
    items = [f"run: `{data['run_id']}` on `{data['device']}`, {data['started_at']} to {data['finished_at']}",
             f"verdict: **{data['verdict']}** (exit code {data['exit_code']}): {data['message']}"]
    if data["first_divergence"]:
        items.append(f"first divergence (outputs in topological order): `{data['first_divergence']}`")
    expectation = data["expectation"]
    if expectation.get("stated"):
        met = "met" if expectation["met"] else "NOT met: " + "; ".join(expectation["problems"])
        items.append(f"expected: {expectation['verdict']}; {met}")
    items += tensor_parallel(data) + training_ranks(data) + paddle_levels(data) + environments(data)
    case = data["case"]
    if case:
        items.append(f"runners: a = `{case['runners'][0]}` vs b = `{case['runners'][1]}`")
        items.append(f"case: `{case['op']}` {case['dtype']} tp={case['tp']} tokens={case['tokens']} "
                     f"shapes={case['shapes']} config={case['config']} (from `{case['source']}`)")
    if data["harness"].get("inputs"):
        items.append(f"inputs: `{data['harness']['inputs']}`")
    checkpoint = data["checkpoint"]
    if checkpoint:
        items.append(f"checkpoint: `{checkpoint['folder']}`")
        if checkpoint.get("perturbed"):
            p = checkpoint["perturbed"]
            items.append(f"negative control: side {p['side']} reads `{p['tensor']}` with bit {p['bit']} of "
                         f"element {p['index']} flipped")
    return [h(1, f"{data['case_name']}: {data['verdict']}"), ul(items)]


def tensor_parallel(data: dict) -> list[str]:
    """How the sides were launched and gathered, and, for a TP=N vs TP=M run, which tensors are TP-invariant."""
    items = []
    c = data["comparison"]
    if c and c.get("kind") == "tensor_parallel":
        items.append(f"comparison: {c['runner']} at TP={c['tp_a']} (side a) against {c['runner']} at "
                     f"TP={c['tp_b']} (side b); no case expectation applies")
        if "tp_invariant" in c:
            items.append(f"TP-invariant (bitwise equal): {', '.join(c['tp_invariant']) or 'none'}; "
                         f"not TP-invariant: {', '.join(c['not_tp_invariant']) or 'none'}")
    for side in data["sides"]:
        launch, gather = side["meta"].get("launch"), side["meta"].get("gather", {})
        if not launch:
            continue
        parts = [f"{name}: " + (f"split on dim {g['split_dim']}" if "split_dim" in g else
                                "replicated, identical on every rank" if g["identical_across_ranks"] else
                                f"replicated, DIFFERS between ranks (mismatches vs rank 0: {g['mismatches_vs_rank0']})")
                 for name, g in gather.items()]
        items.append(f"side {side['label']} launched by {launch['launcher']} with {launch.get('ranks', launch['tp'])} "
                     f"ranks at {launch.get('master', '')}" + (f"; gathered: {'; '.join(parts)}" if parts else ""))
    return items


def training_ranks(data: dict) -> list[str]:
    """A training run on several ranks: whether every rank ended every step with rank 0's state; for a DP=N vs DP=M
    (or EP) run, the quantities that stay bitwise and the step each other one parts at."""
    items = []
    c = data["comparison"]
    if c and c.get("kind") in ("data_parallel", "expert_parallel"):
        kind = "DP" if c["kind"] == "data_parallel" else "EP"
        items.append(f"comparison: {c['runner']} at DP={c['dp_a']} EP={c['ep_a']} (side a) against {c['runner']} at "
                     f"DP={c['dp_b']} EP={c['ep_b']} (side b), on the same global batch; no case expectation applies")
        if "bitwise" in c:
            departs = ", ".join(f"`{q}` from step {k}" for q, k in c["departs"].items())
            items.append(f"{kind}-invariant (bitwise equal at every step): {', '.join(c['bitwise']) or 'none'}; "
                         f"departs: {departs or 'none'}")
    for side in data["sides"]:
        agree = side["meta"].get("ranks_agree")
        if agree:
            items.append(f"side {side['label']}: every rank's state after every step against rank 0's "
                         f"({agree['checked']} tensors): " + (
                             "identical" if not agree["differing_count"] else
                             f"{agree['differing_count']} DIFFER (first: {', '.join(agree['differing'][:5])})"))
    return items


def paddle_levels(data: dict) -> list[str]:
    """For a level against level run (``--versus-impl``): the two levels and which tensors they give bitwise equal."""
    c = data["comparison"]
    if not c or c.get("kind") != "paddle_impl":
        return []
    items = [f"comparison: {c['runner']} at implementation level {c['impl_a']} (side a) against level {c['impl_b']} "
             "(side b), on the same inputs; no case expectation applies"]
    if "equal" in c:
        items.append(f"bitwise equal: {', '.join(c['equal']) or 'none'}; differ: {', '.join(c['differ']) or 'none'}")
    return items


def environments(data: dict) -> list[str]:
    """For an environment against environment run (``--versus environment=NAME``): which interpreter each side had."""
    c = data["comparison"]
    if not c or c.get("kind") != "environment":
        return []
    version = {side["label"]: side["meta"].get("versions", {}).get("transformers", "?") for side in data["sides"]}
    return [f"comparison: {c['runner']} in {c['environment_a'] or 'the harness interpreter'} (side a: transformers "
            f"{version.get('a', '?')}) against {c['environment_b']} (side b: transformers {version.get('b', '?')}), on "
            "the same checkpoint; no case expectation applies"]
