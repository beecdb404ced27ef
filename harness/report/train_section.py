"""Training cases (op causal_lm_train): the report along time. The first divergence in time, one row per step (the
scalars equal or how far apart, "k of 794" per state quantity, the step's first differing output), the scalars'
values, which side the float64 truth finds closer, the picture of mismatches per step and quantity, and per step the
differing tensors (expert families folded). Data from ``harness.compare.train_steps`` (``CaseResult.train``)."""

from __future__ import annotations

from harness.compare.model_outputs import group_rows
from harness.report.blocks import details, figure, h, p, table, ul

# A quantity not named here (an optimizer's state: exp_avg, momentum_buffer, ...) is labelled by its own name.
QUANTITY_LABELS = {"lr": "lr", "loss": "loss", "grad": "gradients", "grad_norm": "grad norm",
                   "clip_coeff": "clip coefficient", "master": "masters", "param": "parameters",
                   "expert_bias": "routing bias", "loss_path": "loss path (md5)", "per_token_loss": "per-token loss",
                   "final_loss": "final loss"}


def label(quantity: str) -> str:
    return QUANTITY_LABELS.get(quantity, quantity)


def headline(data: dict) -> list[str]:
    train = data.get("train") or {}
    if not train:
        return []
    steps = train["steps"]
    first = train["first_divergence"]
    equal_steps = sum(1 for s in steps if s["verdict"] == "BITWISE_PASS")
    if train.get("loss_only"):  # harness.compare.loss_logs: the losses a log or loss.json holds, nothing else
        lacks = train["loss_only"].get("lacks", "no gradient, optimizer state or parameter was captured")
        lines = [f"**{equal_steps} of {len(steps)} steps BITWISE_PASS** ({train['loss_only']['what']}; {lacks})"]
    else:
        lines = [f"**{equal_steps} of {len(steps)} steps BITWISE_PASS** ({train['parameters']} parameters; tensors "
                 f"of steps {_steps(train['steps_kept'], len(steps))} kept, the others compared by digest)"]
    if first:
        lines.append(f"**first divergence in time: step {first['step']}, {label(first['quantity'])}** "
                     f"(`{first['tensor']}`; order within a step: "
                     f"{', '.join(label(q) for q in train['order'])})")
    semantic = train.get("semantic")
    if semantic:
        state = ("passed" if semantic["ok"] else f"FAILED: mapping error at step {semantic.get('first_step')}, "
                 f"`{semantic['first_mismatch']}` ({semantic.get('judged_by')})")
        floors = f"; floors stated for {len(semantic['floors'])} tensors" if semantic["floors"] else ""
        parts = ", ".join(f"{p['judged_by']} {p['checked']} ({p['max_relative_error']:.2g})"
                          for p in semantic.get("parts", []))
        lines.append(f"float64 check of every step {state}: max relative error at scale "
                     f"{semantic['max_relative_error']:.3g} (limit {semantic['agreement']:.0e}{floors}; tensors "
                     f"judged: {parts})" + (f"; not judged: {semantic['not_judged']}" if semantic.get("not_judged")
                                            else ""))
    truth = train.get("truth") or {}
    if truth and truth["status"] != "ok":
        lines.append(f"float64 truth: {truth['status']}: {truth['reason']}")
    check = truth.get("check")
    if check:  # harness.compare.train_truth
        unreliable = "; ".join(f"**unreliable at step {k}**: {why}" for k, why in check["unreliable"].items())
        checked = ", ".join(map(str, check["checked"])) or "none"
        lines.append(f"float64 truth (python `{truth['python']}`) against {check['formula']}: steps {checked} "
                     f"checked; {unreliable or 'every one follows it'}")
    lines += [f"**farther from the float64 truth than expected**: step {f['step']}, {f['quantity']}, side {f['side']} "
              f"({f['runner']}): its step off by {f['error']:.3g} of the truth's" for f in train.get("farther", [])]
    refeed = train.get("refeed")
    if refeed and refeed["status"] != "ok":
        lines.append(f"re-feed in time: **{refeed['status']}**: {refeed['reason']}")
    elif refeed:
        checked = {mode: check["checked"] for mode, check in refeed.get("faithful", {}).items()}
        lines.append("re-feed in time faithful: where side b's plain run started a step from side a's inputs, the "
                     "re-fed step gave its bits (" + "; ".join(f"{mode}: steps {', '.join(map(str, steps)) or 'none'}"
                                                           for mode, steps in checked.items()) + ")")
    return lines


def _steps(kept: list[int], total: int) -> str:
    if kept == list(range(1, total + 1)):
        return "all"
    return ", ".join(map(str, kept)) or "none"


def _scalar_cell(scalar: dict | None) -> str:
    if scalar is None:
        return "—"
    if scalar["equal"] is None:
        return scalar["note"]
    if scalar["equal"]:
        return "equal"
    ulps = scalar["ulps"]
    return f"{ulps:.3g} {scalar['unit']}" if ulps < 1e6 else f"differs ({ulps:.3g} {scalar['unit']})"


def _count_cell(quantities: dict, quantity: str) -> str:
    q = quantities.get(quantity)
    return "" if q is None else f"{q['equal']} of {q['total']}"


def states_of(train: dict) -> list[str]:
    """The tensor quantities this run has, in the step's order (masters only in bf16)."""
    return [q for q in train["order"] if q not in SCALAR_COLUMNS and any(q in s["quantities"]
                                                                      for s in train["steps"])]


def step_header(train: dict) -> list[str]:
    return ["step", "verdict", "lr", "loss", "grad norm", "clip coeff",
            *(label(q) for q in states_of(train)), "first differing output"]


def step_rows(train: dict) -> list[list]:
    rows = []
    for s in train["steps"]:
        rows.append([s["step"], s["verdict"], *(_scalar_cell(s["scalars"].get(k)) for k in SCALAR_COLUMNS),
                     *(_count_cell(s["quantities"], q) for q in states_of(train)),
                     f"`{s['first_divergence']}`" if s["first_divergence"] else ""])
    return rows


def refeed_lines(refeed: dict) -> list[str]:
    """One line per step: each differing quantity and what made its tensors' differences."""
    lines = []
    for step in refeed.get("steps", []):
        made = "; ".join(f"{label(q)}: {how}" for q, how in step["attribution"].items())
        lines.append(f"step {step['step']}: {made or 'nothing differs'}")
    return lines


def refeed_blocks(train: dict) -> list[tuple]:
    refeed = train.get("refeed")
    if not refeed or refeed["status"] not in ("ok", "unfaithful"):  # unfaithful: shown, the headline says so
        return []
    order = [q for q in train["order"] if any(q in s["attribution"] for s in refeed["steps"])]
    return [h(3, "Re-feed in time: what made each step's differences (tensors)"),
            p("Side b re-run twice from side a's state after the previous step (parameters, masters, the optimizer's "
              "state, routing biases; side a's lr): once on its own gradients, once on side a's. Made by the step's "
              "forward/backward: differs from side a's state already; made by the optimizer on side a's gradients: its "
              "norm, clip and update differ even there; made by the step's gradients: differs on its own gradients "
              "only; "
              "carried in: "
              "equal once re-fed (the difference came with the state)."),
            table(["step", *(label(q) for q in order)],
                  [[s["step"], *(s["attribution"].get(q, "equal") for q in order)] for s in refeed["steps"]],
                  "r" + "l" * len(order))]


def blocks(data: dict, figures: dict) -> list[tuple]:
    train = data.get("train") or {}
    if not train:
        return []
    out = [h(2, "Training steps"), ul(headline(data)),
           h(3, "Per step (side a against side b; state tensors: bitwise equal of all)"),
           table(step_header(train), step_rows(train), "r" + "l" * (len(step_header(train)) - 1)),
           h(3, "Scalars (a / b)"),
           p("Each at the precision the stack applies it (the gradients' dtype for the norm and the clip factor); "
             "where a stack holds a Python double beside it (Megatron's norm and clip coefficient), the double in "
             "brackets, shown, not compared."),
           table(["step", "lr", "loss per micro-batch (as backpropagated)", "grad norm", "clip coeff"],
                 [[s["step"], *(_scalar_values(s["scalars"].get(k)) for k in SCALAR_COLUMNS)]
                  for s in train["steps"]], "rllll")]
    if any("truth" in s for s in train["steps"]):
        out += [h(3, "Closer to the float64 truth (tensors per quantity: a / b / tie)"),
                p(train["truth"]["what"]),
                table(["step", *(label(q) for q in train["order"])],
                      [[s["step"], *(_tally(s.get("truth", {}).get(q)) for q in train["order"])]
                       for s in train["steps"]], "r" + "l" * len(train["order"]))]
    out += refeed_blocks(train)
    if "train" in figures:
        out += [h(3, "Mismatches per step and quantity"),
                figure(figures["train"]["map"], "share of tensors differing per step and quantity")]
    tensors = data.get("tensors") or []
    for s in train["steps"]:
        rows = [t for t in tensors if t["name"].startswith(f"step{s['step']}.") and t["status"] != "EQUAL"]
        if rows:
            out.append(details(f"step {s['step']}: {len(rows)} differing tensors", [_tensor_table(rows)]))
    return out


SCALAR_COLUMNS = ("lr", "loss", "grad_norm", "clip_coeff")


def _scalar_values(scalar: dict | None) -> str:
    if scalar is None:
        return "—"
    if scalar["equal"] is None:
        return scalar["note"]
    return " / ".join(_value(scalar[label]) + (f" ({scalar[label + '_double']!r})" if label + "_double" in scalar
                                               else "") for label in "ab")


def _value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:.9g}" for v in value) + "]"
    return f"{value:.17g}"


def _tally(tally: dict | None) -> str:
    return "" if not tally else f"{tally['a']} / {tally['b']} / {tally['tie']}"


def _tensor_table(rows: list[dict]) -> tuple:
    body = []
    for t in group_rows(rows):
        first = t["first_mismatch"]
        where = f"{first['index']}: {first['a_bits']} vs {first['b_bits']}" if first else t.get("note", "")
        body.append([t["name"], t["status"], t["mismatches"], f"{t['mismatch_share']:.4%}", t["max_ulp"],
                     f"{t['max_abs_error']:.3g}", f"{t['max_error_in_scale_ulps']:.3g}", where])
    return table(["tensor", "status", "mismatches", "share", "max ULP", "max abs err", "ULPs at scale",
                  "first mismatch"], body, "llrrrrrl")
