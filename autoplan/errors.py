"""User-facing errors: one clear paragraph, exit status 2, no traceback (see cli.main)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user. The message names the problem and the fix."""

    exit_code = 2


class NoFeasiblePlan(Exception):
    """Nothing fits: not a crash and not bad input, exit status 1."""

    exit_code = 1


class DryRunMismatch(NoFeasiblePlan):
    """`autoplan check` found the runtime's job unlike the model (exit status 1)."""
