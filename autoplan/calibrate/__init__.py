"""`autoplan calibrate`: measure the nodes (measure.py, torch + stdlib only, runs under torchrun),
fit the measurements into a hardware file (fit.py), and the cost model's error on it (error.py)."""
