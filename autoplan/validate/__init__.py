"""The cost model against measurements: published training runs and measured run directories."""
