"""A train.py that must fail cleanly: usage torchrun ... bad_input_worker.py PLAN.json KIND"""

import json
import sys

from autoplan.runtime import parse_args, train
from runtime_models import builder

if __name__ == "__main__":
    train(builder(sys.argv[2]), json.load(open(sys.argv[1])), parse_args(["--steps", "2"]))
    print("TRAINED")  # must not be reached
