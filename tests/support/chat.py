"""A scripted chat-completions server on 127.0.0.1 speaking the OpenAI protocol to the real client."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedServer:
    """Speaks POST /v1/chat/completions; each request takes the next scripted reply."""

    def __init__(self, script: list):
        self.script = list(script)
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                status, payload = outer.script.pop(0) if outer.script else (200, tool_call("finish", summary="done"))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()


_n = [0]


def completion(message: dict) -> dict:
    _n[0] += 1
    return {"id": f"cmpl-{_n[0]}", "object": "chat.completion", "created": 0, "model": "glm-test",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}


def tool_call(name: str, raw_args: str | None = None, **args) -> dict:
    _n[0] += 1
    return completion({"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{_n[0]}", "type": "function",
         "function": {"name": name, "arguments": raw_args if raw_args is not None else json.dumps(args)}}]})


def ok(payload: dict) -> tuple[int, dict]:
    return 200, payload
