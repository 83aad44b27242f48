"""autoplan: find the fastest (or cheapest) way to split a model across GPUs, before buying them."""

__version__ = "0.1.0"
