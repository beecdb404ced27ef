"""Reports for people and machines, rendered from results; nothing here decides a verdict.

Every people's report (a run's report.md/report.html, a sweep's, the gate matrix's matrix.md/matrix.html,
the nightly's) is built ONCE as a list of blocks (``blocks``: headings, paragraphs, lists, tables,
preformatted text, figures, collapsible details) and rendered twice, by ``to_markdown`` and ``to_html``
(one self-contained page, pictures embedded). So the Markdown and the HTML cannot say different things;
``tests/test_report_blocks.py`` checks it on a run with every section present.

Modules: ``case_report`` (one run: ``SECTIONS``, write, console), its sections (``summary_section``,
``tensor_sections``, ``refeed_section``, ``check_sections``, ``provenance_section``), ``pictures`` (PNGs),
``sweep_report``, ``gate_matrix_report``, ``nightly_report`` and ``junit``. Commands only call ``write``
and ``console`` here; report.json is each result's own ``to_dict()``.

Adding a section to the run report is one function and one line:

    # harness/report/model_section.py
    from harness.report.blocks import h, p, table

    def blocks(data: dict, figures: dict) -> list[tuple]:
        '''`data` is CaseResult.to_dict() (what report.json holds); return [] when the run has nothing to say.'''
        model = data.get("model") or {}
        if not model:
            return []
        return [h(2, "Model gradients"), p(f"{model['passed']} of {model['total']} gradients BITWISE_PASS"),
                table(["expert", "gradients", "BITWISE_PASS"], model["rows"], "lrr")]

then put ``model_section.blocks`` into ``case_report.SECTIONS`` where it should appear. Both report.md and
report.html pick it up; the console summary (``case_report.console``) is separate and short on purpose.
"""
