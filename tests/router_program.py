"""A router process as `grpo-pipeline serve` runs one, without a registry: champion v1 and challenger v2 (folders
under ROOT/adapters, what the stand-in engine checks) on an engine the router's own `Engine` starts with vLLM's
command line (the stand-in vLLM server where tests/stand_in_vllm is on PYTHONPATH), the request log in SQLite at
ROOT/ab.sqlite, the engine recorded for the next router (`ab.serve.reattach_engine`), served by `router.run`
(the port bound at once, the engine brought up in the background, supervised). What the stack's supervisord runs
in the router-restart checks, in place of `grpo-pipeline serve`.

    python tests/router_program.py DATA_DIR PORT
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from grpo_pipeline.configs.ab import ServeConfig
from grpo_pipeline.tasks.serve.ab_log import RequestLog
from grpo_pipeline.tasks.serve.adapters import Adapter
from grpo_pipeline.tasks.serve.api import CHALLENGER, CHAMPION
from grpo_pipeline.tasks.serve.engine import Engine, EngineError
from grpo_pipeline.tasks.serve.router import Router, run


def main(data_dir: Path, port: int) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = ServeConfig(probe_s=0.5, probe_timeout_s=10, retry_after_s=1, reattach_engine=True)
    arms = {}
    for alias, version in ((CHAMPION, "1"), (CHALLENGER, "2")):
        path = data_dir / "adapters" / f"{alias}-v{version}"
        path.mkdir(parents=True, exist_ok=True)
        arms[alias] = Adapter(alias, version, path, "base-a", "aaa", 8)
    request_log = RequestLog.open(f"sqlite:///{data_dir / 'ab.sqlite'}")
    serve_dir = data_dir / "serve"  # as `serve` lays it out under data_dir
    engine = Engine(sys.executable, "base-a", cfg, serve_dir / "engine.log", record=serve_dir / "engine.json")
    router = Router(
        engine=engine,
        client=None,
        request_log=request_log,
        spool=serve_dir / "unlogged.jsonl",
        challenger_fraction=0.5,
        api_key=None,
        base="base-a",
        base_sha256="aaa",
        max_rank=16,
        request_timeout_s=cfg.request_timeout_s,
        retry_after_s=cfg.retry_after_s,
    )
    router.arms = dict(arms)
    router.loaded = {a.engine_name: a.path for a in arms.values()}
    try:
        run(router, "127.0.0.1", port, arms.get, cfg)
    except EngineError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        engine.stop()
        request_log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
