"""``python -m target_stack.serve``: generate with the engine from the command line or over HTTP.

    python -m target_stack.serve "hello" "another prompt" --max-tokens 16
    echo "one prompt per line" | python -m target_stack.serve -
    python -m target_stack.serve --http 8000      # POST /v1/completions on 127.0.0.1
    python -m target_stack.serve --http 8000 --prefix-cache   # reuse the prefixes of earlier prompts

Text is tokenised as UTF-8 bytes (the models have random weights: the output is not language,
it is a reproducible token stream).  The HTTP endpoint speaks the OpenAI completions shape:
``{"model", "prompt": str | [str], "max_tokens", "temperature", "top_p", "seed"}``; with the prefix
cache, ``usage.prompt_tokens_details.cached_tokens`` counts the prompt positions it reused.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from target_stack.engine import LLMEngine, RequestError, SamplingParams


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


class Server:
    """One engine behind a lock: requests are batched per call, served one call at a time."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.lock = threading.Lock()

    def complete(self, body: dict) -> tuple[int, dict]:
        prompts = body.get("prompt")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or not prompts:
            return 400, _error("prompt must be a non-empty string or a list of strings")
        tokens = [encode(p) for p in prompts]
        try:
            params = SamplingParams(max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 0.0),
                                    top_p=body.get("top_p", 1.0), seed=body.get("seed"))
            with self.lock:
                prefix = self.engine.prefix
                before = prefix.stats["reused_tokens"] if prefix else 0
                outs = self.engine.generate(tokens, params)
                cached = prefix.stats["reused_tokens"] - before if prefix else 0
        except RequestError as e:
            return 400, _error(str(e))
        choices = [{"index": i, "text": decode(o.tokens), "finish_reason": o.finish_reason, "logprobs": None}
                   for i, o in enumerate(outs)]
        usage_in = sum(map(len, tokens))
        usage_out = sum(len(o.tokens) for o in outs)
        return 200, {"id": f"cmpl-{time.monotonic_ns()}", "object": "text_completion", "created": int(time.time()),
                     "model": self.model_name, "choices": choices,
                     "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out,
                               "total_tokens": usage_in + usage_out,
                               "prompt_tokens_details": {"cached_tokens": cached}}}


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def make_handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            if self.path.rstrip("/") != "/v1/completions":
                return self._send(404, _error(f"no route {self.path}; POST /v1/completions"))
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except (ValueError, json.JSONDecodeError):
                return self._send(400, _error("the body must be a JSON object"))
            if not isinstance(body, dict):
                return self._send(400, _error("the body must be a JSON object"))
            self._send(*server.complete(body))

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": server.model_name, "object": "model"}]})
            self._send(404, _error(f"no route {self.path}"))

        def log_message(self, *args):  # quiet
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_stack.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompts", nargs="*", help="prompts ('-' reads one prompt per line from stdin)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve POST /v1/completions on 127.0.0.1:PORT")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="keep prompts' KV pages and KDA states for later prompts that start the same way")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = LLMEngine(args.preset, device=device, prefix_cache=args.prefix_cache)
    if args.http is not None:
        handler = make_handler(Server(engine, f"target_stack-{args.preset}"))
        httpd = ThreadingHTTPServer(("127.0.0.1", args.http), handler)
        print(f"serving target_stack-{args.preset} on http://127.0.0.1:{httpd.server_address[1]}/v1/completions",
              flush=True)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        return 0
    prompts = [line.rstrip("\n") for line in sys.stdin] if args.prompts == ["-"] else args.prompts
    if not prompts:
        parser.error("give prompts, '-' for stdin, or --http PORT")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        outs = engine.generate([encode(p) for p in prompts], params)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs, strict=True):
        print(json.dumps({"prompt": prompt, "tokens": out.tokens, "text": decode(out.tokens),
                          "finish_reason": out.finish_reason, "ttft_ms": round(1e3 * out.ttft_s, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
