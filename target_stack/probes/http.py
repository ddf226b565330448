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
import time
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
    """The status and JSON answer of a request, every wait bounded by ``timeout`` (an answer that is not JSON
    comes back as ``{"unparsed": its first characters}``)."""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, _json(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _json(e.read())


def _json(data: bytes) -> dict:
    try:
        return json.loads(data or b"{}")
    except ValueError:
        return {"unparsed": data[:200].decode("utf-8", errors="replace")}


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


class _Hung(Exception):
    """A request waited out its timeout: the server stopped answering, so the check's later requests would
    only wait out theirs again."""


def _ask(ctx: ProbeContext, url: str, data: bytes, timeout: float, what: str, where: dict) -> tuple[int, dict] | None:
    """POST ``data``: the status and answer, or None with the failure recorded when none came (``_Hung`` raised
    when it waited out ``timeout``)."""
    try:
        return _post(url, data, timeout)
    except Exception as exc:  # a server that hangs up or hangs is a located failure
        ctx.fail(f"{what} got no answer (timeout {timeout:g} s): {raised_message(exc)}", **where)
        if _hung(exc):
            raise _Hung from exc
        return None


def _hung(exc: BaseException) -> bool:
    """Whether a request failed by waiting out its timeout (not by a connection the server dropped)."""
    return isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError)


def _twin_answer(twin, body: dict) -> tuple[list | None, int | str]:
    """What the twin engine gives for a request body, by the endpoint's definition (``prompt`` one string or a
    list, ``max_tokens`` 16, ``temperature`` 0, ``top_p`` 1 and ``seed`` None when left out): its outputs and
    the prompt positions its prefix cache reused, or None and the message it refuses the request with."""
    from target_stack.engine import RequestError, SamplingParams

    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    before = twin.prefix.stats["reused_tokens"]
    try:
        params = SamplingParams(max_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 0.0),
                                top_p=body.get("top_p", 1.0), seed=body.get("seed"))
        outs = twin.generate([_tokens(x) for x in prompts], params)
    except RequestError as e:
        return None, str(e)
    return outs, twin.prefix.stats["reused_tokens"] - before


def _describe(body: dict) -> str:
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    sampling = (f"temperature {body['temperature']}, top_p {body['top_p']}, seed {body['seed']}" if "seed" in body
                else "greedy")
    sizes = [len(x) for x in prompts]
    return f"{len(prompts)} prompt(s) of {sizes} characters, max_tokens {body.get('max_tokens')}, {sampling}"


def _mismatches(code: int, got: dict, body: dict, want: list, reused: int) -> list[str]:
    """How an answer differs from the twin's outputs for the same request (empty when it does not)."""
    if code != 200 or not isinstance(got, dict) or not isinstance(got.get("choices"), list):
        return [f"answered {code}: {json.dumps(got)[:200]}"]
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    choices = sorted(got["choices"], key=lambda c: c.get("index", -1))
    bad = [f"choice count {len(choices)}, not {len(want)}"] if len(choices) != len(want) else []
    for j, (c, w) in enumerate(zip(choices, want)):
        if c.get("index") != j:
            bad.append(f"choice {j} has index {c.get('index')}")
        if c.get("text") != _detokenise(w.tokens):
            bad.append(f"choice {j} text {c.get('text')!r}, not {_detokenise(w.tokens)!r} (tokens {w.tokens})")
        if c.get("finish_reason") != w.finish_reason:
            bad.append(f"choice {j} finish_reason {c.get('finish_reason')!r}, not {w.finish_reason!r}")
    usage = got.get("usage") or {}
    n_in, n_out = sum(len(_tokens(x)) for x in prompts), sum(len(w.tokens) for w in want)
    expect = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    bad += [f"usage.{k} {usage.get(k)}, not {v}" for k, v in expect.items() if usage.get(k) != v]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached != reused:
        bad.append(f"usage.prompt_tokens_details.cached_tokens {cached}, not the {reused} prompt positions "
                   "the prefix cache reused")
    return bad


@probe(kind="correctness")
def completions(ctx: ProbeContext) -> None:
    """POST /v1/completions with one prompt and with a list, greedy and seeded sampling, prompts that share
    a stem (the prefix cache's reuse is reported as cached tokens): every choice's text and finish reason,
    and the usage, equal what the twin engine gives for the same requests.  Then the same from several
    clients at once: each answer is the one the twin gives for that request alone.  Then GET /v1/models,
    and the answers to bad requests (the endpoint's own refusals and the engine's): each refused with an
    error, and a good request after each still answered (the twin's answer) within a short timeout."""
    from http.server import ThreadingHTTPServer

    from target_stack.engine import LLMEngine
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
    httpd.daemon_threads = True  # a handler thread stuck in the server under test must not hold the probe's exit
    thread = threading.Thread(target=httpd.serve_forever, name="serve", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    mismatches = 0
    try:
        for i, body in enumerate(calls):
            where = dict(file=SERVE, symbol="Server.complete", condition=f"call {i + 1}: {_describe(body)}")
            want, reused = _twin_answer(twin, body)
            try:
                code, got = _post(base + "/v1/completions", json.dumps(body).encode(), timeout)
            except Exception as exc:  # noqa: BLE001 - a server that hangs up or hangs is a located failure
                ctx.fail(f"the request got no answer (timeout {timeout:g} s): {raised_message(exc)}", **where)
                mismatches += 1
                if _hung(exc):  # its later requests would only wait out the timeout again
                    break
                continue
            bad = _mismatches(code, got, body, want, reused)
            for b in bad:
                ctx.fail(b, **where)
            mismatches += bool(bad)
        else:
            ctx.metric("calls", len(calls))
            wrong, hung = _check_concurrent(ctx, base, served, twin, draw)
            mismatches += wrong
            if not hung:
                _check_routes(ctx, base, name, timeout)
                mismatches += _check_refusals(ctx, base, twin, draw)
        ctx.metric("mismatches", mismatches, better="lower")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _check_concurrent(ctx: ProbeContext, base: str, served, twin, draw: Draw) -> tuple[int, bool]:
    """Several clients post at once (released together by a barrier): one prompt and lists, greedy and seeded,
    different lengths.  Each must be answered 200 within the timeout with exactly what the twin engine gives for
    that request alone (what is in flight beside a request must change nothing of its answer: not its tokens,
    not its seeded samples, not its usage), and once all are answered the served engine holds no unfinished
    request and leaks nothing the twin does not.  Returns the number of requests answered wrongly or not, and
    whether one waited out its timeout."""
    p = ctx.params
    k, n = int(p.get("concurrent", 6)), int(p.get("max_tokens", 4))
    timeout = float(p.get("concurrent_timeout_s", 30))
    bodies = []
    for i in range(k):  # fresh random prompts: no prefix of one is any other's, so no request reuses another's pages
        prompt = _text(draw, 9 + 7 * i) if i % 2 == 0 else [_text(draw, 6 + 5 * i), _text(draw, 33 - 3 * i)]
        body = {"prompt": prompt, "max_tokens": n + 2 * (i % 3)}
        if i % 3 == 1:
            body.update(temperature=0.8, top_p=0.9, seed=int(draw.randint(10_000, (1,))))
        bodies.append(body)
    wants = [_twin_answer(twin, body) for body in bodies]
    answers: list = [None] * k
    gate = threading.Barrier(k)

    def client(i: int) -> None:
        try:
            gate.wait(timeout)
        except threading.BrokenBarrierError:
            pass
        try:
            answers[i] = _post(base + "/v1/completions", json.dumps(bodies[i]).encode(), timeout)
        except Exception as exc:  # noqa: BLE001 - judged below
            answers[i] = exc

    clients = [threading.Thread(target=client, args=(i,), name=f"client-{i}", daemon=True) for i in range(k)]
    start = time.monotonic()
    for t in clients:
        t.start()
    for t in clients:
        t.join(max(0.0, start + timeout + 5 - time.monotonic()))
    wrong, hung = 0, False
    for i, (body, (want, reused), answer) in enumerate(zip(bodies, wants, answers)):
        where = dict(file=SERVE, symbol="Server.complete",
                     condition=f"{k} concurrent requests, request {i + 1}: {_describe(body)}")
        if answer is None or isinstance(answer, Exception):
            why = "still waiting" if answer is None else raised_message(answer)
            ctx.fail(f"posted with {k - 1} other requests in flight, it got no answer (timeout {timeout:g} s): {why}",
                     **where)
            wrong += 1
            hung |= answer is None or _hung(answer)
            continue
        bad = _mismatches(*answer, body, want, reused)
        for b in bad:
            ctx.fail(f"posted with {k - 1} other requests in flight: {b}", **where)
        wrong += bool(bad)
    ctx.metric("concurrent_calls", k)
    ctx.metric("concurrent_s", time.monotonic() - start, unit="s")
    if not any(t.is_alive() for t in clients):
        where = dict(file=SERVE, symbol="Server.complete", condition=f"after {k} concurrent requests")
        ctx.check(not served.has_unfinished(), f"the served engine still holds {len(served.seqs)} unfinished "
                  "request(s) after every request was answered", **where)
        leaks, twin_leaks = served.leaks(), twin.leaks()
        extra = {kind: held for kind, held in leaks.items() if held and not twin_leaks.get(kind)}
        ctx.check(not extra, f"the served engine leaks {extra} after the concurrent requests (the twin, fed the "
                  "same requests one at a time, does not)", **where)
    return wrong, hung


def _check_routes(ctx: ProbeContext, base: str, name: str, timeout: float) -> None:
    """GET /v1/models names the model."""
    where = dict(file=SERVE, symbol="make_handler", condition="GET /v1/models")
    try:
        code, got = _open(base + "/v1/models", timeout)
    except Exception as exc:  # noqa: BLE001
        ctx.fail(f"the request failed: {raised_message(exc)}", **where)
        return
    ids = [m.get("id") for m in got.get("data", [])] if isinstance(got, dict) else []
    ctx.check(code == 200 and ids == [name], f"GET /v1/models answered {code} with models {ids}, not [{name!r}]",
              **where)


def _check_refusals(ctx: ProbeContext, base: str, twin, draw: Draw) -> int:
    """Bad requests of every kind, each answered with an OpenAI error object: the endpoint's own refusals (400
    or 404) and the requests the engine refuses (the twin decides: what it refuses must be answered 400, what it
    takes must be answered as it answers), bad sampling parameters and prompt plus max_tokens past the model
    length among them.  After each, a good request (the twin's answer) must still be answered within
    ``liveness_timeout_s``: a refusal must leave nothing held.  The first server that stops answering ends the
    check (its later requests would only wait out the timeout again).  Returns the number of failures."""
    p = ctx.params
    timeout = float(p.get("liveness_timeout_s", 15))
    url = base + "/v1/completions"
    over = twin.max_model_len
    refusals = [  # what, the code's symbol, route, body (bytes as sent; a dict is judged by the twin), code
        ("a body that is not JSON", "make_handler", "/v1/completions", b"{not json", 400),
        ("a JSON body that is not an object", "make_handler", "/v1/completions", b"[1, 2]", 400),
        ("an unknown route", "make_handler", "/v1/chat/nothing", b"{}", 404),
        ("an empty prompt list", "Server.complete", "/v1/completions", {"prompt": []}, 400),
        ("a prompt that is not a string", "Server.complete", "/v1/completions", {"prompt": 7}, 400),
        ("a prompt list holding a non-string", "Server.complete", "/v1/completions", {"prompt": ["ab", None]}, 400),
        ("an empty prompt", "Server.complete", "/v1/completions", {"prompt": ""}, None),
        ("prompt plus max_tokens past the model length", "Server.complete", "/v1/completions",
         {"prompt": _text(draw, 11), "max_tokens": over}, None),
        ("a prompt longer than the model length", "Server.complete", "/v1/completions",
         {"prompt": [_text(draw, over + 1)], "max_tokens": 1}, None),
        ("max_tokens 0", "Server.complete", "/v1/completions", {"prompt": _text(draw, 7), "max_tokens": 0}, None),
        ("a max_tokens that is not an integer", "Server.complete", "/v1/completions",
         {"prompt": _text(draw, 7), "max_tokens": 2.5}, None),
        ("a negative temperature", "Server.complete", "/v1/completions",
         {"prompt": _text(draw, 7), "temperature": -1.0, "max_tokens": 2}, None),
        ("top_p 0", "Server.complete", "/v1/completions",
         {"prompt": _text(draw, 7), "temperature": 1.0, "top_p": 0.0, "max_tokens": 2}, None),
        ("a seed that is not an integer", "Server.complete", "/v1/completions",
         {"prompt": _text(draw, 7), "temperature": 1.0, "seed": "7", "max_tokens": 2}, None),
    ]
    failures = 0
    for j, (what, symbol, route, body, want_code) in enumerate(refusals):
        where = dict(file=SERVE, symbol=symbol, condition=f"POST {route} with {what}")
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        good = {"prompt": _text(draw, 6 + j % 5), "max_tokens": 2}  # the liveness request, greedy and seeded in turn
        if j % 2:
            good.update(temperature=0.7, top_p=0.95, seed=int(draw.randint(10_000, (1,))))
        try:
            if want_code is None:  # the engine's to judge: what the twin refuses is answered 400, the rest as it does
                want, why = _twin_answer(twin, body)
                if want is not None:
                    answer = _ask(ctx, base + route, data, timeout, "the request", where)
                    if answer is None:
                        failures += 1
                        continue
                    bad = _mismatches(*answer, body, want, why)
                    for b in bad:
                        ctx.fail(b, **where)
                    failures += bool(bad)
                else:
                    want_code = 400
            if want_code is not None:
                answer = _ask(ctx, base + route, data, timeout, what, where)
                if answer is None:
                    failures += 1
                else:
                    code, got = answer
                    message = (got.get("error") or {}).get("message") if isinstance(got, dict) else None
                    if not ctx.check(code == want_code and isinstance(message, str) and message,
                                     f"{what} was answered {code} {json.dumps(got)[:120]}, not {want_code} with an "
                                     "error message", **where):
                        failures += 1
            want, reused = _twin_answer(twin, good)
            after = f"after {what} was refused, a good request ({_describe(good)})"
            answer = _ask(ctx, url, json.dumps(good).encode(), timeout, after, where)
        except _Hung:
            return failures + 1
        if answer is None:
            failures += 1
            continue
        bad = _mismatches(*answer, good, want, reused)
        for b in bad:
            ctx.fail(f"{after}: {b}", **where)
        failures += bool(bad)
    ctx.metric("refusals", len(refusals))
    return failures
