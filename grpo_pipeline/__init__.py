"""grpo-pipeline: configuration, tracking and the CLI; the stages live in tasks/, the trainer in trainer/."""

import logging

# bitsandbytes warns on CPUs with AVX512-BF16 that an optional hub kernel is missing; it falls back
# to its own CPU kernel, and the hub is not reachable from our machines anyway.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
