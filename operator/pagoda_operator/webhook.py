"""The validating admission webhook for InferenceServices: an AdmissionReview in, a decision out.

It serves on every operator replica from start-up, beside leader election rather than inside
kopf: kopf serves its admission handlers only within ``kopf.run``, which this operator enters
only while it holds the leader Lease (``cli.py``), and a webhook whose failure policy is Fail
must answer on every replica its Service routes to, standbys included. kopf's ``WebhookServer``
still does the HTTPS serving and picks up renewed certificate files.

The rules are in :mod:`pagoda_operator.admission`; the requester's access is asked of the API
server (a SubjectAccessReview for the user in the request's ``userInfo``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import kopf

from pagoda_operator import GROUP, KIND
from pagoda_operator.admission import Access, Policy, refusal, review
from pagoda_operator.spec import (
    all2all_backend_field_errors,
    data_parallel_experts_field_errors,
    disaggregation_field_errors,
    model_source_errors,
)

log = logging.getLogger("pagoda_operator.webhook")

# user (the request's userInfo), namespace, access -> allowed?
UserCan = Callable[[Mapping[str, Any], str, Access], bool]


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def decide(request: Any, policy: Policy, user_can: UserCan) -> dict[str, Any]:
    """The AdmissionReview response for an AdmissionReview request.

    A malformed ``spec.model.uri`` (or remote-source option) or ``spec.disaggregation``, and a
    ``spec.parallelism.dataParallelExperts`` or ``all2allBackend`` the daemon would refuse, are refused as invalid (422)
    naming the field. Only a change of ``spec`` is reviewed: metadata-only updates (kopf's
    bookkeeping annotations, labels) change no pod. An error while asking for the requester's
    access refuses the request (fail closed) with the error in the message.
    """
    request = _map(request)
    req = _map(request.get("request"))

    def answer(allowed: bool, message: str = "", code: int = 403) -> dict[str, Any]:
        response: dict[str, Any] = {"uid": str(req.get("uid") or ""), "allowed": allowed}
        if not allowed:
            reason = {403: "Forbidden", 422: "Invalid"}.get(code, "InternalError")
            response["status"] = {"code": code, "reason": reason, "message": message}
        return {
            "apiVersion": str(request.get("apiVersion") or "admission.k8s.io/v1"),
            "kind": "AdmissionReview",
            "response": response,
        }

    kind = _map(req.get("kind"))
    if kind.get("group") != GROUP or kind.get("kind") != KIND:
        return answer(True)
    obj, old = _map(req.get("object")), _map(req.get("oldObject"))
    if req.get("operation") not in ("CREATE", "UPDATE") or not obj:
        return answer(True)
    spec = _map(obj.get("spec"))
    if req.get("operation") == "UPDATE" and spec == _map(old.get("spec")):
        return answer(True)
    meta = _map(obj.get("metadata"))
    namespace = str(req.get("namespace") or meta.get("namespace") or "")
    name = str(meta.get("name") or meta.get("generateName") or "")
    # A model reference the daemon cannot read (the daemon's own parser says why), a malformed
    # disaggregation, data-parallel experts the daemon would refuse: refused here rather than by a
    # Degraded status after the apply.
    invalid = (model_source_errors(spec.get("model")) + disaggregation_field_errors(spec.get("disaggregation"))
               + data_parallel_experts_field_errors(spec.get("parallelism"))
               + all2all_backend_field_errors(spec.get("parallelism")))
    if invalid:
        return answer(False, f"InferenceService {namespace}/{name} is invalid: " + "; ".join(invalid), 422)
    user = _map(req.get("userInfo"))
    try:
        violations = review(policy, spec, lambda access: user_can(user, namespace, access))
    except Exception as e:
        log.warning("admission of %s/%s: access check failed: %s", namespace, name, e)
        return answer(
            False, f"could not check the requester's access, so nothing widening is allowed: {e}", 500
        )
    if violations:
        log.info("refused %s of %s/%s by %s", req.get("operation"), namespace, name, user.get("username"))
        return answer(False, refusal(namespace, name, violations))
    return answer(True)


class AdmissionWebhook:
    """kopf's HTTPS ``WebhookServer`` answering with :func:`decide`, in a thread of its own."""

    def __init__(self, server: kopf.WebhookServer, policy: Policy, user_can: UserCan):
        self.server, self.policy, self.user_can = server, policy, user_can
        self._thread: threading.Thread | None = None
        self._stop: Callable[[], object] = lambda: None

    async def handle(self, request: Any, **_: Any) -> dict[str, Any]:
        # decide() may wait on SubjectAccessReviews: off the event loop.
        return await asyncio.to_thread(decide, request, self.policy, self.user_can)

    def start(self, timeout: float = 30.0) -> None:
        """Serve in a daemon thread; return once listening, raise if it could not start (port in
        use, unreadable certificate)."""
        started: Future[None] = Future()
        loop = asyncio.new_event_loop()

        async def serve() -> None:
            async for _client_config in self.server(self.handle):
                if not started.done():
                    started.set_result(None)

        task = loop.create_task(serve())

        def run() -> None:
            try:
                loop.run_until_complete(task)
            except asyncio.CancelledError:
                pass
            except BaseException as e:
                if not started.done():
                    started.set_exception(e)
                else:
                    log.error("the admission webhook stopped: %s", e)
            finally:
                loop.close()

        self._stop = lambda: loop.call_soon_threadsafe(task.cancel)
        self._thread = threading.Thread(target=run, name="admission-webhook", daemon=True)
        self._thread.start()
        started.result(timeout)

    def stop(self) -> None:
        """Stop serving (closes the listening socket) and wait for the thread."""
        if self._thread is not None:
            self._stop()
            self._thread.join(timeout=10)
            self._thread = None
