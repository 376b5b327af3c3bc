"""Prefill/decode disaggregation's router (``pagoda pd-proxy``).

Each completion goes first to a prefill instance with one token to generate: it computes the
prompt and its disk tier keeps the prompt's full KV blocks. Then the request, unchanged, goes
to a decode instance whose ``kv_offload_disk_source`` is the prefill instance's disk tier (or
its transfer port on another host): its scheduler finds the prompt's blocks there (hard-linked
or fetched into its own tier, docs/kv-offload.md), loads them instead of computing them, and
generates the answer, streamed or not, which the proxy passes back as it comes. A prefill
instance on another host names itself in a signed ``x-pagoda-kv-source`` answer header, which
the proxy adds to the decode request: the decode instance then fetches from whichever prefill
instance answered. vLLM's P/D examples route the same way.

Several instances of each role (``--prefill`` and ``--decode`` repeated, xPyD): each request
goes to the instance of its role with the fewest requests in flight through this proxy (in turn
among equals). A prefill instance that cannot be reached, or answers 429 or 5xx, passes the
request to the next; when none computed the prompt, the decode instance computes it itself (a
slower answer, never a lost one). A decode instance that refuses the connection passes it to the
next (nothing was sent); one that fails after that fails the request (502): its tokens may have
been generated. ``--prefill-file`` names a file listing prefill instances, one URL a line (the
operator's ConfigMap, mounted): the proxy reads it again by path at most once a second and routes
to what it lists, keeping the last valid list while it cannot be read or is not valid; with none
listed, the decode instance computes every prompt.

The proxy holds no credentials of its own: a client's ``Authorization`` header goes to both
instances, which check it (docs/security.md). ``/ready`` is ready while at least one instance
of each role is (with one of each, a pod running the three is Ready only when all are), and
``/metrics`` is the decode instance's when there is one (its requests, KV cache and prefix hits
are what the proxy's clients see), followed by the proxy's own ``pagoda_pd_proxy_*`` counters.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request,
# imported inside build_app so that the CLI does not import FastAPI) when they are defined.
import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda_daemon.kv_offload.transfer_auth import SOURCE_HEADER
from pagoda_daemon.server.errors import APIError, bad_request

log = logging.getLogger(__name__)

RESPONSES_ROUTE = "/v1/responses"
MESSAGES_ROUTE = "/v1/messages"  # Anthropic's
ROUTES = ("/v1/completions", "/v1/chat/completions", RESPONSES_ROUTE, MESSAGES_ROUTE)
FORWARDED_HEADERS = ("authorization", "content-type", "x-request-id")
# What the prefill request must not carry: it generates one token, unstreamed, once, with no
# grammar. Whatever shapes the prompt (messages, tools, chat_template_kwargs) stays, so that the
# prefill instance computes the very blocks the decode instance will look for.
_NOT_FOR_PREFILL = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_completion_tokens",
                    "response_format", "structured_outputs", "tool_choice")
_NOT_FOR_RESPONSES_PREFILL = ("text", "include", "top_logprobs")  # its output format and logprobs


def prefill_request(body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    """The request the prefill instance gets: the same prompt, one token, no stream."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    if path == RESPONSES_ROUTE:
        out = {k: v for k, v in out.items() if k not in _NOT_FOR_RESPONSES_PREFILL}
        out["max_output_tokens"] = 1
        return out
    if path == MESSAGES_ROUTE and isinstance(out.get("output_config"), dict):  # its effort shapes the prompt
        out["output_config"] = {k: v for k, v in out["output_config"].items() if k != "format"}
    out["max_tokens"] = 1
    return out


def forwarded_headers(headers: Any) -> dict[str, str]:
    """What of a client's headers goes on to the instances: its credentials, content type and id."""
    return {k: v for k, v in headers.items() if k.lower() in FORWARDED_HEADERS}


MAX_INSTANCES = 64  # of each role
# A prefill instance answering with these has not refused the request itself: another may serve it.
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(eq=False)
class Instance:
    role: str
    url: str
    in_flight: int = 0


class Instances:
    """The instances of one role, offered least busy first (requests in flight through this
    proxy; in turn among equals, so that an idle pool is used round robin)."""

    def __init__(self, role: str, urls: list[str]) -> None:
        self.role = role
        self.all = [Instance(role, url.rstrip("/")) for url in urls]
        self._turn = itertools.count()

    def by_load(self) -> list[Instance]:
        if not self.all:
            return []
        first = next(self._turn) % len(self.all)
        return sorted(self.all[first:] + self.all[:first], key=lambda i: i.in_flight)  # stable: in turn

    def replace(self, urls: list[str]) -> tuple[list[Instance], list[Instance]]:
        """Lists these instances from now on, and returns those added and those dropped. One still
        listed keeps its object: its count of requests in flight stays right. A dropped one's
        requests in flight finish on the object they hold."""
        old = {i.url: i for i in self.all}
        self.all = [old.get(url) or Instance(self.role, url) for url in dict.fromkeys(u.rstrip("/") for u in urls)]
        now = {i.url for i in self.all}
        return [i for i in self.all if i.url not in old], [i for url, i in old.items() if url not in now]


RELOAD_S = 1.0  # an instance file is read again at most this often


def listed_urls(text: str) -> list[str]:
    """The instance URLs an instance file lists, one a line (blank lines and ``#`` comments
    skipped), each once; ValueError for a line that is not an http(s) URL, or too many."""
    urls: dict[str, None] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith(("http://", "https://")):
            raise ValueError(f"line {n} must be an http(s) URL, not {line!r}")
        urls[line.rstrip("/")] = None
    if len(urls) > MAX_INSTANCES:
        raise ValueError(f"it lists {len(urls)} instances, at most {MAX_INSTANCES} are allowed")
    return list(urls)


class InstanceFile:
    """The instances a file lists after the fixed ones (``--prefill``), followed while serving.
    The kubelet swaps a mounted ConfigMap's file by replacing a symlink: the file is read again
    by its path and compared by content, not watched. Content that cannot be read or is not
    valid leaves the last valid list in place, with one warning per distinct bad content."""

    def __init__(self, path: str, fixed: list[str]) -> None:
        self.path, self.fixed = path, [u.rstrip("/") for u in fixed]
        self._content = Path(path).read_bytes()  # at start, unreadable or invalid is an error
        self.urls = self._parse(self._content)
        self._checked = time.monotonic()
        self._bad: bytes | str | None = None  # the last bad content (or read error) warned about

    def _parse(self, content: bytes) -> list[str]:
        urls = self.fixed + [u for u in listed_urls(content.decode()) if u not in self.fixed]
        if len(urls) > MAX_INSTANCES:
            raise ValueError(f"with --prefill it makes {len(urls)} instances, at most {MAX_INSTANCES} are allowed")
        return urls

    def changed(self) -> list[str] | None:
        """The new list when the file has changed to another valid one; None otherwise or when
        it was checked less than RELOAD_S ago."""
        now = time.monotonic()
        if now - self._checked < RELOAD_S:
            return None
        self._checked = now
        try:
            content = Path(self.path).read_bytes()
        except OSError as e:
            self._warn(describe(e), f"cannot be read ({describe(e)})")
            return None
        if content == self._content:
            self._bad = None
            return None
        try:
            urls = self._parse(content)
        except ValueError as e:  # UnicodeDecodeError is one
            self._warn(content, str(e))
            return None
        self._content, self.urls, self._bad = content, urls, None
        return urls

    def _warn(self, bad: bytes | str, why: str) -> None:
        if bad != self._bad:
            self._bad = bad
            log.warning("pd-proxy: %s %s: still routing to the %d instance(s) it listed before",
                        self.path, why, len(self.urls))


PROBE_TIMEOUT_S = 5.0  # a probe of an instance: well inside a kubelet probe's own timeout
KEEPALIVE_S = 2.0  # an idle connection to an instance is closed after this, before the instance's 5 s


def describe(error: Exception) -> str:
    """An exception as a client can read it: httpx's often have no message (a dropped connection)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def not_ready_answer(role: str, status_code: int, body: Any) -> dict[str, Any]:
    """The proxy's 503 body for an instance that is not ready: the instance's reason and start-up
    phases, each named after its role, so a reader of the proxy's ``/ready`` (the operator's
    ``startupPhase``) sees which instance is still loading and what it does."""
    body = body if isinstance(body, dict) else {}
    phases = body.get("startup") if isinstance(body.get("startup"), list) else []
    return {"status": "not ready",
            "reason": f"{role} instance: {body.get('reason') or body.get('status') or f'HTTP {status_code}'}",
            "startup": [{**p, "phase": f"{role}: {p.get('phase')}"} for p in phases if isinstance(p, dict)]}


def build_app(prefill_urls: str | list[str], decode_urls: str | list[str], timeout_s: float = 600.0,
              transport: Any = None, *, prefill_file: str | None = None):
    """The proxy's ASGI app (``transport``: an httpx transport for the instances, for tests);
    ``prefill_file`` lists more prefill instances, followed while serving (OSError or ValueError
    when it cannot be read or is not valid now)."""
    import httpx  # here: `pagoda --help` and the delegated commands need neither it nor fastapi
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    prefill_urls = [prefill_urls] if isinstance(prefill_urls, str) else prefill_urls
    listed = InstanceFile(prefill_file, prefill_urls) if prefill_file is not None else None
    prefills = Instances("prefill", listed.urls if listed is not None else prefill_urls)
    decodes = Instances("decode", [decode_urls] if isinstance(decode_urls, str) else decode_urls)
    registry = CollectorRegistry()  # this app's own: two proxies in one process do not mix counts
    routed = Counter("pagoda_pd_proxy_requests", "Requests sent to an instance, by how they ended (ok: answered "
                     "200; refused: answered another status, passed to the client; failed: unreachable, or "
                     "429/5xx from a prefill instance)", ["role", "instance", "outcome"], registry=registry)
    computed_by_decode = Counter("pagoda_pd_proxy_prefill_skipped", "Requests whose prompt no prefill instance "
                                 "computed: the decode instance computed it", registry=registry)
    in_flight = Gauge("pagoda_pd_proxy_in_flight", "Requests an instance is answering", ["role", "instance"],
                      registry=registry)
    listed_count = Gauge("pagoda_pd_proxy_instances", "Instances listed, by role", ["role"], registry=registry)

    def gauge(instance: Instance) -> None:
        in_flight.labels(instance.role, instance.url).set_function(functools.partial(getattr, instance, "in_flight"))

    for instances in (prefills, decodes):
        listed_count.labels(instances.role).set_function(functools.partial(lambda i: len(i.all), instances))
        for instance in instances.all:
            gauge(instance)

    def reload() -> None:
        """Routes to what the prefill file lists now, when it has changed (checked at most once a
        second, when a request or probe needs the list)."""
        urls = listed.changed() if listed is not None else None
        if urls is None:
            return
        added, dropped = prefills.replace(urls)
        for instance in added:
            gauge(instance)
        for instance in dropped:
            in_flight.remove(instance.role, instance.url)
        if added or dropped:
            log.info("pd-proxy: %s now lists %d prefill instance(s): added %s, dropped %s", prefill_file,
                     len(prefills.all), [i.url for i in added], [i.url for i in dropped])
    # Idle connections are dropped before the instances' (uvicorn closes them after 5 s): a request
    # sent on a connection the instance is closing fails with nothing received.
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), transport=transport,
                               limits=httpx.Limits(max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S))
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()  # on shutdown: the pooled connections to the instances

    app = FastAPI(title="pagoda pd-proxy", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    def passed(response: Any):
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))

    def count(instance: Instance, outcome: str) -> None:
        routed.labels(instance.role, instance.url, outcome).inc()

    async def prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """The first prefill instance's answer that is 200 or the request's own refusal (4xx);
        None when none could compute the prompt."""
        for instance in prefills.by_load():
            instance.in_flight += 1
            try:
                answer = await client.post(instance.url + path, json=prefill_request(body, path), headers=headers)
            except httpx.HTTPError:
                count(instance, "failed")
                continue
            finally:
                instance.in_flight -= 1
            if answer.status_code in RETRIED_STATUSES:
                count(instance, "failed")
                continue
            count(instance, "ok" if answer.status_code == 200 else "refused")
            return answer
        computed_by_decode.inc()
        return None

    async def decode(path: str, raw: bytes, headers: dict[str, str]) -> tuple[Instance, Any]:
        """A decode instance's answer, its body still to read (the caller lowers ``in_flight``)."""
        for instance in decodes.by_load():
            instance.in_flight += 1
            answered = False
            try:
                request = client.build_request("POST", instance.url + path, content=raw, headers=headers)
                answer = await client.send(request, stream=True)
                answered = True
                return instance, answer
            except httpx.ConnectError:  # nothing was sent: another instance may answer
                count(instance, "failed")
            except httpx.HTTPError:
                count(instance, "failed")
                raise
            finally:
                if not answered:
                    instance.in_flight -= 1
        raise httpx.ConnectError(f"none of the {len(decodes.all)} decode instance(s) accepted a connection")

    async def relay(request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise bad_request(f"the request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        headers = forwarded_headers(request.headers)
        reload()
        try:
            first = await prefill(path, body, headers)
            if first is not None and first.status_code != 200:  # the request cannot be served: the prefill instance says why
                return passed(first)
            # where the prefill instance keeps the prompt's KV (between hosts), signed by it: the
            # decode instance checks it and fetches from there (kv_offload/transfer.py)
            source = first.headers.get(SOURCE_HEADER) if first is not None else None
            if source is not None:
                headers = {**headers, SOURCE_HEADER: source}
            instance, answer = await decode(path, raw, headers)
        except httpx.HTTPError as e:
            raise APIError(f"an instance behind the proxy did not answer: {describe(e)}", 502,
                           code="bad_gateway") from e
        count(instance, "ok" if answer.status_code == 200 else "refused")
        if answer.status_code != 200 or not body.get("stream"):
            try:
                await answer.aread()
            except httpx.HTTPError as e:
                raise APIError(f"the decode instance did not answer: {describe(e)}", 502, code="bad_gateway") from e
            finally:
                await answer.aclose()
                instance.in_flight -= 1
            return passed(answer)

        async def passed_through():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:  # also when the client goes away mid-stream: the decode connection goes back
                await answer.aclose()
                instance.in_flight -= 1

        return StreamingResponse(passed_through(), media_type=answer.headers.get("content-type"))

    for path in ROUTES:
        async def route(request: Request, path: str = path):
            return await relay(request, path)

        app.add_api_route(path, route, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        headers = forwarded_headers(request.headers)
        errors = []
        for instance in decodes.by_load():
            try:
                return passed(await client.get(instance.url + "/v1/models", headers=headers))
            except httpx.HTTPError as e:
                errors.append(describe(e))
        raise APIError(f"the decode instance did not answer: {'; '.join(errors)}", 502, code="bad_gateway")

    async def probe(instance: Instance, path: str) -> Any:
        try:
            return await client.get(instance.url + path, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as e:
            return e

    async def answers(instances: Instances, path: str) -> list[tuple[Instance, Any]]:
        """Each instance's answer to a probe (an exception for one that did not answer), asked
        all at once: one by one, 64 instances that do not answer would outlast any probe."""
        return list(zip(instances.all, await asyncio.gather(*(probe(i, path) for i in instances.all)), strict=True))

    @app.get("/health")
    async def health():
        reload()
        ok = True
        for instances in (prefills, decodes):
            ok = ok and any(not isinstance(r, Exception) and r.status_code == 200
                            for _, r in await answers(instances, "/health"))
        return Response(status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready():
        """Ready while an instance of each role is; otherwise the first instance's reason."""
        reload()
        body: dict[str, Any] = {"status": "ready"}
        for instances in (prefills, decodes):
            role = instances.role
            if not instances.all:
                where = f" in {prefill_file}" if prefill_file is not None else ""
                return JSONResponse({"status": "not ready", "startup": [],
                                     "reason": f"no {role} instance is listed{where}"}, status_code=503)
            probes = await answers(instances, "/ready")
            ready_bodies = [_json(r) for _, r in probes if not isinstance(r, Exception) and r.status_code == 200]
            if not ready_bodies:
                r = probes[0][1]
                if isinstance(r, Exception):
                    return JSONResponse({"status": "not ready", "startup": [],
                                         "reason": f"{role} instance did not answer: {describe(r)}"}, status_code=503)
                return JSONResponse(not_ready_answer(role, r.status_code, _json(r)), status_code=503)
            body[role] = ready_bodies[0]
            if len(instances.all) > 1:
                body[f"{role}_ready"] = f"{len(ready_bodies)} of {len(instances.all)}"
        return body

    @app.get("/metrics")
    async def metrics():
        reload()
        own = generate_latest(registry)
        if len(decodes.all) > 1:  # scrape each decode instance itself: their series would collide here
            return Response(own, media_type="text/plain; version=0.0.4; charset=utf-8")
        try:
            r = await client.get(decodes.all[0].url + "/metrics", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError as e:
            raise APIError(f"the decode instance did not answer: {describe(e)}", 502, code="bad_gateway") from e
        if r.status_code != 200:
            return passed(r)
        text = r.content if r.content.endswith(b"\n") or not r.content else r.content + b"\n"
        return Response(text + own, media_type=r.headers.get("content-type"))

    return app


def _json(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return {}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", default=[],
                   help="a prefill instance's URL (http://host:port); repeat for several")
    p.add_argument("--prefill-file", metavar="PATH",
                   help="a file listing prefill instances' URLs, one a line (# comments), read again "
                   "when it changes (a mounted ConfigMap); with --prefill too, the instances of both")
    p.add_argument("--decode", action="append", required=True, help="a decode instance's URL; repeat for several")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if not args.prefill and args.prefill_file is None:
        print("pagoda pd-proxy: name prefill instances with --prefill or --prefill-file")
        return 2
    for name in ("prefill", "decode"):
        urls = getattr(args, name)
        if len(urls) > MAX_INSTANCES or len(set(urls)) != len(urls):
            print(f"pagoda pd-proxy: --{name} may name at most {MAX_INSTANCES} instances, each once")
            return 2
        for url in urls:
            if not url.startswith(("http://", "https://")):
                print(f"pagoda pd-proxy: --{name} must be an http(s) URL, not {url!r}")
                return 2
    if not 1 <= args.port <= 65535 or not args.timeout > 0:
        print("pagoda pd-proxy: --port must be 1..65535 and --timeout positive")
        return 2
    if args.prefill_file is not None:
        try:
            InstanceFile(args.prefill_file, args.prefill)
        except OSError as e:
            print(f"pagoda pd-proxy: --prefill-file {args.prefill_file} cannot be read: {describe(e)}")
            return 2
        except ValueError as e:
            print(f"pagoda pd-proxy: --prefill-file {args.prefill_file}: {e}")
            return 2
    uvicorn.run(build_app(args.prefill, args.decode, args.timeout, prefill_file=args.prefill_file),
                host=args.host, port=args.port, log_level="warning")
    return 0
