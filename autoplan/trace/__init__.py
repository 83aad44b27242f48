"""The trace stage: a model on meta tensors -> ModelGraph (ops, blocks, parallelism facts)."""
