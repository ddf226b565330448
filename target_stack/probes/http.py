"""The HTTP front of the engine (``target_stack/serve.py``) over real HTTP on 127.0.0.1.

The served engine is judged against a twin: an engine of the same weights and options driven directly, fed
the same requests in the same order (so its prefix cache makes the same decisions).  Whatever the engine
itself computes is judged elsewhere (engine.correctness, engine.prefix_reuse); here only what the endpoint
adds: the prompts it tokenises, the sampling parameters it passes on, the texts, finish reasons and usage it
reports, and its answers to bad requests.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.error
import urllib.request

import torch

from feedback.probe import ProbeContext, probe
from target_stack.probes.reference import Draw, raised_message

SERVE = "target_stack/serve.py"


def _post(url: str, body: bytes, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    return _open(req, timeout)


def _open(req: urllib.request.Request | str, timeout: float) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _tokens(text: str) -> list[int]:
    """The endpoint's tokenisation by its definition: the text's UTF-8 bytes, one token each."""
    return list(text.encode("utf-8"))


def _detokenise(tokens: list[int]) -> str:
    """The text of generated tokens by the same definition: the byte tokens as UTF-8 (an undecodable byte
    replaced), tokens past the bytes left out."""
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def _text(draw: Draw, n: int) -> str:
    """n random printable ASCII characters (one token each)."""
    return "".join(chr(32 + int(c)) for c in draw.randint(95, (n,)))


@probe(kind="correctness")
def completions(ctx: ProbeContext) -> None:
    """POST /v1/completions with one prompt and with a list, greedy and seeded sampling, prompts that share
    a stem (the prefix cache's reuse is reported as cached tokens): every choice's text and finish reason,
    and the usage, equal what the twin engine gives for the same requests.  Then GET /v1/models, and the
    answers to a body that is not JSON, an empty prompt list and an unknown route."""
    from http.server import ThreadingHTTPServer

    from target_stack.engine import LLMEngine, SamplingParams
    from target_stack.model.model import PRESETS, HybridModel
    from target_stack.serve import Server, make_handler

    p = ctx.params
    draw = Draw(ctx.device)
    seed = int(draw.randint(2**31 - 1, (1,)))
    cfg = dataclasses.replace(PRESETS[p.get("preset", "tiny")], seed=seed)
    opts = dict(device=ctx.device, prefix_cache=True, page_size=p.get("page_size", 16))
    served, twin = LLMEngine(HybridModel(cfg), **opts), LLMEngine(HybridModel(cfg), **opts)
    timeout = float(p.get("timeout_s", 60))
    n = p.get("max_tokens", 4)
    stem = _text(draw, p.get("stem", 70))
    calls = [
        {"prompt": stem + _text(draw, 5), "max_tokens": n},
        {"prompt": [stem + _text(draw, 9), _text(draw, 23)], "max_tokens": n},
        {"prompt": stem[: len(stem) // 2] + _text(draw, 40), "max_tokens": n, "temperature": 0.9, "top_p": 0.8,
         "seed": int(draw.randint(10_000, (1,)))},
    ]
    name = f"target_stack-{p.get('preset', 'tiny')}"
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(Server(served, name)))
    thread = threading.Thread(target=httpd.serve_forever, name="serve", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    mismatches = 0
    try:
        for i, body in enumerate(calls):
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            where = dict(file=SERVE, symbol="Server.complete",
                         condition=f"call {i + 1}: {len(prompts)} prompt(s) of {[len(x) for x in prompts]} characters"
                                   + (f", temperature {body['temperature']}, top_p {body['top_p']}, seed "
                                      f"{body['seed']}" if "seed" in body else ", greedy"))
            before = twin.prefix.stats["reused_tokens"]
            params = SamplingParams(max_tokens=n, temperature=body.get("temperature", 0.0),
                                    top_p=body.get("top_p", 1.0), seed=body.get("seed"))
            want = twin.generate([_tokens(x) for x in prompts], params)
            reused = twin.prefix.stats["reused_tokens"] - before
            try:
                code, got = _post(base + "/v1/completions", json.dumps(body).encode(), timeout)
            except Exception as exc:  # noqa: BLE001 - a server that hangs up or hangs is a located failure
                ctx.fail(f"the request failed: {raised_message(exc)}", **where)
                mismatches += 1
                continue
            if not ctx.check(code == 200 and isinstance(got.get("choices"), list),
                             f"answered {code}: {json.dumps(got)[:200]}", **where):
                mismatches += 1
                continue
            choices = sorted(got["choices"], key=lambda c: c.get("index", -1))
            bad = [f"choice count {len(choices)}, not {len(want)}"] if len(choices) != len(want) else []
            for j, (c, w) in enumerate(zip(choices, want)):
                if c.get("index") != j:
                    bad.append(f"choice {j} has index {c.get('index')}")
                if c.get("text") != _detokenise(w.tokens):
                    bad.append(f"choice {j} text {c.get('text')!r}, not {_detokenise(w.tokens)!r} (tokens {w.tokens})")
                if c.get("finish_reason") != w.finish_reason:
                    bad.append(f"choice {j} finish_reason {c.get('finish_reason')!r}, not {w.finish_reason!r}")
            usage = got.get("usage", {})
            n_in, n_out = sum(len(_tokens(x)) for x in prompts), sum(len(w.tokens) for w in want)
            expect = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
            bad += [f"usage.{k} {usage.get(k)}, not {v}" for k, v in expect.items() if usage.get(k) != v]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached != reused:
                bad.append(f"usage.prompt_tokens_details.cached_tokens {cached}, not the {reused} prompt positions "
                           "the prefix cache reused")
            for b in bad:
                ctx.fail(b, **where)
            mismatches += bool(bad)
        ctx.metric("calls", len(calls))
        ctx.metric("mismatches", mismatches, better="lower")
        _check_routes(ctx, base, name, timeout)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _check_routes(ctx: ProbeContext, base: str, name: str, timeout: float) -> None:
    """GET /v1/models names the model; bad requests are answered 400 or 404 with an OpenAI error object."""
    where = dict(file=SERVE, symbol="make_handler")
    try:
        code, got = _open(base + "/v1/models", timeout)
        ids = [m.get("id") for m in got.get("data", [])] if isinstance(got, dict) else []
        ctx.check(code == 200 and ids == [name], f"GET /v1/models answered {code} with models {ids}, not [{name!r}]",
                  **where, condition="GET /v1/models")
        for what, url, body, want in (("a body that is not JSON", "/v1/completions", b"{not json", 400),
                                      ("a JSON body that is not an object", "/v1/completions", b"[1, 2]", 400),
                                      ("an empty prompt list", "/v1/completions", b'{"prompt": []}', 400),
                                      ("an unknown route", "/v1/chat/nothing", b"{}", 404)):
            code, got = _post(base + url, body, timeout)
            message = (got.get("error") or {}).get("message") if isinstance(got, dict) else None
            ctx.check(code == want and isinstance(message, str) and message,
                      f"{what} was answered {code} {json.dumps(got)[:120]}, not {want} with an error message",
                      **where, condition=f"POST {url} with {what}")
    except Exception as exc:  # noqa: BLE001
        ctx.fail(f"the request failed: {raised_message(exc)}", **where)
