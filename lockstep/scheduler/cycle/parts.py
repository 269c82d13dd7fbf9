"""Requests in parts: what the dispatcher keeps of a pass the planner splits across cycles.

The planner (`planner.Part`) runs a pass larger than its model's pace in parts of whole datums,
one part per cycle of that model. Between two parts the dispatcher keeps the whole request
(decoded once) and the results of the parts that ran; the last part's cycle joins them
(`engine.parts.join_results`) into the one result the request is answered with. The engine keeps
the request's undo point (`TrainingEngine.run_passes`, "Parts").

Nothing here is durable, on purpose: a request in parts is recorded only whole, with its last
part, so the replay log holds only completed requests. A request whose model left the engine
(restarted, paged out, restored) is forgotten and starts again from its first part on the
restored state, which holds none of its parts' gradients.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field

from lockstep.engine.parts import join_results, part_request
from lockstep.engine.types import PassRequest, PassResult
from lockstep.scheduler.planner import Datums, Part


@dataclass
class _Held:
    request: PassRequest  # the whole request
    results: list[PassResult] = field(default_factory=list)  # of its parts so far
    done: int = 0  # datums run


def datum_tokens(req: PassRequest) -> tuple[int, ...]:
    """Each datum's pass tokens (its model input), as `translate.pass_tokens` counts them."""
    return tuple(len(d.tokens) for d in req.data)


class RequestsInParts:
    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def datums(self) -> dict[str, Datums]:
        """Every request in parts, for the planner: its datums' sizes and how many ran."""
        return {rid: Datums(datum_tokens(h.request), h.done) for rid, h in self._held.items()}

    def keep_only(self, queued: Container[str], resident: Container[str]) -> None:
        """Forget requests no longer queued, and those whose model left the engine since their
        last part (its restored state holds none of their gradients): they start again."""
        self._held = {
            rid: h
            for rid, h in self._held.items()
            if rid in queued and h.request.model_id in resident
        }

    def part(self, whole: PassRequest | None, request_id: str, part: Part) -> PassRequest:
        """The engine request of `part`; `whole` is the request, decoded, at its first part
        (later parts take the one kept then)."""
        held = self._held.get(request_id)
        if held is None:
            if whole is None or part.start != 0:
                raise RuntimeError(f"request {request_id} lost its earlier parts")
            held = self._held[request_id] = _Held(whole)
        return part_request(held.request, part.start, part.stop)

    def whole(self, request_id: str) -> PassRequest | None:
        held = self._held.get(request_id)
        return None if held is None else held.request

    def ran(self, part: Part, result: PassResult) -> PassResult | None:
        """`part` ran: the whole request's result once it was the last, else None."""
        held = self._held[result.request_id]
        held.results.append(result)
        held.done = part.stop
        if not part.final:
            return None
        del self._held[result.request_id]
        return join_results(held.results)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._held.pop(rid, None)

    def clear(self) -> None:
        """The engine restarted: every request in parts starts again."""
        self._held.clear()
