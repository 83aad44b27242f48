"""The codegen stage: a Plan -> a job directory (train.py, launch files, plan.json, exports)."""
