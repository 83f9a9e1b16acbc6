"""`python -m trainer --spec job.json`: run one GRPO training job (see trainer/train.py for exit codes)."""

import argparse
import sys

from trainer.train import main

parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
parser.add_argument("--spec", required=True, help="path to a JobSpec JSON file")
sys.exit(main(parser.parse_args().spec))
