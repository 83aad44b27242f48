"""Fixtures of the codegen tests; helpers live in codegen_helpers.py (importable by name,
unlike a conftest, which every test directory has)."""

from codegen_helpers import shellcheck, tiny_job, two_rank_job  # noqa: F401  (fixtures)
