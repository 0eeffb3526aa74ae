"""Batch evaluation: data sets -> ragsnap with several presses and budgets -> scores and a report.

One module per concern: ``items`` (what an evaluation item is), ``bioasq`` / ``datasets`` /
``niah`` (loading and building items), ``metrics`` (scoring one answer), ``fidelity``
(teacher-forced comparison with the full cache), ``runner`` (the resumable loop),
``aggregate`` (per press x budget summaries) and ``report`` (report.md and plots).
"""
