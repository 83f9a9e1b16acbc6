"""`python -m grpo_pipeline.trainer --spec job.json`: run one GRPO training process (see trainer/train.py for exit codes).

Alone it is the whole job; started by torchrun (`python -m grpo_pipeline.trainer.launch`) it is one rank of several.
"""

import time

STARTED = time.monotonic()  # before the heavy imports: a restart's cost includes them

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from grpo_pipeline.trainer.distributed import record  # noqa: E402

record("pid", os.getpid())  # first: the node launcher forwards a SIGTERM to the pids it finds

from grpo_pipeline.trainer.offline import import_bitsandbytes_offline  # noqa: E402

import_bitsandbytes_offline()  # before train imports peft, which imports bitsandbytes with its hub lookup

from grpo_pipeline.trainer.train import main  # noqa: E402

parser = argparse.ArgumentParser(prog="python -m grpo_pipeline.trainer", description=__doc__)
parser.add_argument("--spec", required=True, help="path to a JobSpec JSON file")
sys.exit(main(parser.parse_args().spec, STARTED))
