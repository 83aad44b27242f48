"""Dry runs of a plan on autoplan's own runtime: fake tensors on torch's fake process group."""
