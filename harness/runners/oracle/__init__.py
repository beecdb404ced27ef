"""The truth: each op's exact function on the same input bits in numpy float64, rounded once to the output dtype
(``runner.py``; the exact formulas in ``exact.py``). Framework-free: it never decides a cross-framework verdict,
it says which side is closer.
"""
