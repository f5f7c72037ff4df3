"""A hostile stand-in for a vLLM server, for the secret canary's flag A/B (tests/reliability/test_secret_canary.py).

The canary asks what the HARNESS writes when it launches a profile twice (flag off, flag on) and gates the pair;
a real engine adds minutes and nothing to that question (the real engines' own environments are read from
/proc/<pid>/environ in test_engine_environment.py and test_secret_canary.py). This server answers the vLLM
surface the flag A/B uses (/v1/models, prompt logprobs and greedy generations from the deterministic fake
distribution of tests/engine/test_client_malformed.py) and behaves as an engine that wants the harness's secrets
would: it prints its whole environment to its log, dumps it to ``$VLLM_DS41_STANDIN_DUMP`` when its profile sets that, and
quotes it in a 400 answer to /tokenize. Whatever the launcher handed it would surface in what the harness writes.

    python -m tests.reliability.standin_vllm PORT MODEL
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _answer(path: str, body: dict | None, model: str) -> tuple[int, dict]:
    from tests.engine.test_client_malformed import vllm_generation_response, vllm_prompt_response

    if path == "/v1/models":
        return 200, {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 2048}]}
    if path == "/v1/completions" and isinstance(body, dict):
        if body.get("prompt_logprobs") is not None:
            return 200, vllm_prompt_response(list(body["prompt"]), int(body["prompt_logprobs"]), model=model)
        resp = vllm_generation_response(list(body["prompt"]), int(body.get("max_tokens") or 1),
                                        int(body.get("logprobs") or 1))
        resp["model"] = model
        return 200, resp
    if path == "/tokenize":
        return 400, {"error": {"message": f"my environment: {dict(os.environ)}"}}
    return 404, {"error": {"message": f"no route {path}; environment {dict(os.environ)}"}}


def main(argv: list[str]) -> int:
    port, model = int(argv[0]), argv[1]
    print("stand-in engine environment:", json.dumps(dict(os.environ)), flush=True)
    dump = os.environ.get("VLLM_DS41_STANDIN_DUMP")
    if dump:
        with open(dump, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(dict(os.environ)) + "\n")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            status, reply = _answer(self.path.split("?")[0], body, model)
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, *a) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
