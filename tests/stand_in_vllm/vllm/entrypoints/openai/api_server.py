"""A stand-in for vLLM's OpenAI server, for the tests and the soak of `grpo-pipeline serve` on a machine without
vLLM's CPU build: put `tests/stand_in_vllm` on the engine's PYTHONPATH and the router's own `Engine` starts this
module with vLLM's command line (`python -m vllm.entrypoints.openai.api_server --model ... --lora-modules ...`).

It speaks what the router uses: `/v1/models`, `/v1/completions` and `/v1/chat/completions` (whole or streamed,
the text naming the adapter asked for), `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, each behind the
key in `VLLM_API_KEY`. Like vLLM, it exits at start when an adapter of `--lora-modules` is not there (the engine
that crashes at every start). A real process: the tests kill it (SIGKILL) or hang it (SIGSTOP).
`STAND_IN_ENGINE_START_S`: seconds before it listens (an engine's start-up); `STAND_IN_ENGINE_LATENCY_S`: seconds
each answer takes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--lora-modules", nargs="*", default=[])
    args, _ = parser.parse_known_args(argv)
    loaded: dict[str, str] = {}
    for module in args.lora_modules:
        name, _, path = module.partition("=")
        if not Path(path).is_dir():
            print(f"ValueError: Loading lora {name} failed: no adapter found at {path}", flush=True)
            return 1
        loaded[name] = path
    time.sleep(float(os.environ.get("STAND_IN_ENGINE_START_S", "0")))
    key = os.environ.get("VLLM_API_KEY")
    latency_s = float(os.environ.get("STAND_IN_ENGINE_LATENCY_S", "0"))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's uvicorn

        def _allowed(self) -> bool:
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self._send(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            if not self._allowed():
                return
            if self.path != "/v1/models":
                self._send(404, {"detail": "Not Found"})
                return
            models = [args.model, *loaded]
            self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if not self._allowed():
                return
            if self.path == "/v1/load_lora_adapter":
                if not Path(body["lora_path"]).is_dir():
                    self._send(400, {"error": {"message": f"no adapter at {body['lora_path']}"}})
                    return
                loaded[body["lora_name"]] = body["lora_path"]
                self._send(200, {"status": "loaded"})
            elif self.path == "/v1/unload_lora_adapter":
                loaded.pop(body["lora_name"], None)
                self._send(200, {"status": "unloaded"})
            elif self.path in ("/v1/completions", "/v1/chat/completions"):
                self._generate(body, chat=self.path.endswith("chat/completions"))
            else:
                self._send(404, {"detail": "Not Found"})

        def _generate(self, body: dict, chat: bool) -> None:
            model = body.get("model")
            if model not in loaded and model != args.model:
                self._send(404, {"error": {"message": f"The model `{model}` does not exist."}})
                return
            time.sleep(latency_s)
            words = f"the answer is 42 from {model}".split(" ")
            usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
            if not body.get("stream"):
                text = " ".join(words)
                choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"text": text}
                self._send(200, {"id": "cmpl-stand-in", "model": model, "choices": [choice], "usage": usage})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for word in words:
                    delta = {"index": 0, "delta": {"content": word + " "}} if chat else {"index": 0, "text": word + " "}
                    self._event({"id": "cmpl-stand-in", "model": model, "choices": [delta], "usage": None})
                if (body.get("stream_options") or {}).get("include_usage"):
                    self._event({"id": "cmpl-stand-in", "model": model, "choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

        def _event(self, chunk: dict) -> None:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        def _send(self, status: int, obj: dict) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"stand-in engine serving {args.model} with {', '.join(loaded) or 'no adapter'} on port {args.port}")
    sys.stdout.flush()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
