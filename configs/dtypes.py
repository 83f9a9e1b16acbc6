"""The number formats a base model is held and computed in, typed once: the quantization modes (`model.quantization`,
the job spec's `ModelLoad`, the planner's workload) and the floating-point dtypes (`model.compute_dtype`,
`merge.dtype`, the spec, the planner). A new mode is one word here; every reader's allowed values follow.

Pure typing, importing nothing else of the project: the trainer, a leaf a node runs alone, imports it with the
config's other sections it runs as they are (tests/unit/test_layers.py).
"""

from __future__ import annotations

from typing import Literal

Quantization = Literal["none", "nf4", "fp4", "int8"]  # bitsandbytes: nf4 = QLoRA's, int8 = LLM.int8()
DType = Literal["float32", "bfloat16", "float16"]
