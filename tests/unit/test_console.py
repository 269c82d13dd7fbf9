"""The console's parts that need no server: the metrics per step, the charts, who reads what,
the bundle's budget and its labels (the browser tests drive the whole: test_console.py)."""

from __future__ import annotations

import asyncio
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from lockstep.engine.parts import join_metrics
from lockstep.gateway.console import chart, routes
from lockstep.gateway.deps import Caller, authenticate, read_scope
from lockstep.gateway.errors import ApiError
from lockstep.gateway.settings import GatewaySettings
from lockstep.keyring import KeyRing, owner_of
from lockstep.scheduler.api.run_history import steps_of
from lockstep.scheduler.state.records import HistoryEntry
from lockstep.vocab import OpKind

CONSOLE = Path(routes.__file__).parent
FB, FWD, OPT = OpKind.FORWARD_BACKWARD, OpKind.FORWARD, OpKind.OPTIM_STEP


def entry(seq: int, kind: OpKind, metrics: dict[str, float], datums: int = 2) -> HistoryEntry:
    return HistoryEntry(seq, kind, float(seq), datums if kind != OPT else 0, 10, metrics)


def test_steps_join_their_passes_as_one_request_and_keep_their_numbers_when_trimmed() -> None:
    history = [
        entry(0, FB, {"loss:sum": 4.0, "acc:mean": 0.5}, datums=2),
        entry(1, FB, {"loss:sum": 2.0, "acc:mean": 1.0}, datums=6),  # a second chunk
        entry(2, FWD, {"loss:sum": 9.0}),
        entry(3, OPT, {"grad_norm:mean": 3.0, "step:max": 1.0}),
        entry(4, FB, {"loss:sum": 1.0, "acc:mean": 0.0}),
    ]
    out = steps_of(history, steps_committed=1)
    first, second = out.steps
    assert (first.step, first.complete, second.step, second.complete) == (0, True, 1, False)
    assert dict(first.metrics) == {
        "loss:sum": 6.0,
        "acc:mean": pytest.approx((0.5 * 2 + 1.0 * 6) / 8),
        "forward/loss:sum": 9.0,
        "optim_step/grad_norm:mean": 3.0,
        "optim_step/step:max": 1.0,
    }
    assert (
        first.metrics["loss:sum"]
        == join_metrics([({"loss:sum": 4.0}, 2), ({"loss:sum": 2.0}, 6)])["loss:sum"]
    )
    assert (first.datums, first.tokens, first.time) == (8, 20, 3.0)
    # The head trimmed away (the list keeps the newest ops): the steps keep their numbers.
    trimmed = steps_of(history[3:] + [entry(5, OPT, {}), entry(6, FB, {"loss:sum": 0.5})], 2)
    assert [s.step for s in trimmed.steps] == [0, 1, 2] and trimmed.first_step == 0
    assert steps_of(history[4:], 1).steps[0].step == 1
    # At most N points: consecutive steps averaged, each point saying how many it is.
    long = [
        e
        for i in range(10)
        for e in (entry(2 * i, FB, {"loss:sum": float(i)}), entry(2 * i + 1, OPT, {}))
    ]
    thinned = steps_of(long, 10, most_points=4)
    assert [(p.step, p.steps, p.metrics["loss:sum"]) for p in thinned.steps] == [
        (2, 3, 1.0),
        (5, 3, 4.0),
        (8, 3, 7.0),
        (9, 1, 9.0),
    ]
    assert steps_of([], 0).steps == []


def test_a_long_history_is_drawn_in_bounded_points_that_say_so() -> None:
    xs = [float(i) for i in range(10_000)]
    ys = [1.0 / (1 + i) for i in range(10_000)]
    c = chart.line_chart("loss:sum", xs, ys)
    assert c.points <= chart.MAX_POINTS and c.per_point == 20 and c.last == ys[-1]
    assert c.path.startswith("M") and c.path.count("L") == c.points - 1
    ticks = [int(t.label) for t in c.x_ticks]  # whole steps, at the buckets' mean steps
    assert ticks == sorted(set(ticks)) and len(ticks) == 5 and 0 <= ticks[0] < 20 < 9980 < ticks[-1]
    few = chart.line_chart("x", [0.0, 1.0], [float("nan"), 2.0])  # non-finite values left out
    assert few.points == 1 and few.last == 2.0
    bars = chart.bar_chart("tokens trained", ["a", "b"], [0.0, 5.0])
    assert bars.bars[0].height == 0 and bars.bars[1].height > 0


def _settings(**kw: object) -> GatewaySettings:
    return GatewaySettings(scheduler_address="x:1", **kw)  # type: ignore[arg-type]


def _conn(settings: GatewaySettings, keyring: KeyRing | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        app=SimpleNamespace(state=SimpleNamespace(settings=settings, keyring=keyring))
    )


def test_admin_keys_read_every_owners_runs_only_when_they_ask(tmp_path: Path) -> None:
    conn = _conn(_settings(allow_any_tml_key=True, admin_keys=frozenset({"tml-root"})))
    admin = authenticate(conn, "tml-root")  # type: ignore[arg-type]
    user = authenticate(conn, "tml-user")  # type: ignore[arg-type]
    assert admin == Caller(owner_of("tml-root"), admin=True) and not user.admin

    def scope(caller: Caller, access: str) -> tuple[str, bool]:
        s = asyncio.run(read_scope(caller, access))  # type: ignore[arg-type]
        return s.owner, s.all_owners

    assert scope(admin, "accessible") == (admin.owner, True)
    assert scope(admin, "owned") == (admin.owner, False)
    assert scope(user, "accessible") == (user.owner, False)
    # A fixed key list: the admin key is accepted beside it; a keys file marks its own.
    fixed = _conn(_settings(api_keys=frozenset({"k1"}), admin_keys=frozenset({"a1"})))
    assert authenticate(fixed, "a1").admin and not authenticate(fixed, "k1").admin  # type: ignore[arg-type]
    with pytest.raises(ApiError):
        authenticate(fixed, "tml-other")  # type: ignore[arg-type]
    path = tmp_path / "keys.toml"
    path.write_text(
        '[[key]]\nname = "ops"\nkey = "k-ops"\nadmin = true\n[[key]]\nname = "u"\nkey = "k-u"\n'
    )
    ring = _conn(_settings(keys_file=path), KeyRing.load(path))
    assert authenticate(ring, "k-ops").admin and not authenticate(ring, "k-u").admin  # type: ignore[arg-type]


class _Controls(HTMLParser):
    """Form controls and the label `for`s of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.controls: list[str] = []
        self.labels: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("input", "select", "textarea") and a.get("type") != "hidden":
            self.controls.append(a.get("id") or f"<{tag} without id>")
        if tag == "label" and a.get("for"):
            self.labels.add(a["for"] or "")


def test_every_control_is_labelled_and_the_key_field_says_api_key() -> None:
    shell = routes.templates.get_template("shell.html").render(view="/v", page="runs")
    models = [SimpleNamespace(model_name="m")]
    samplers = [SimpleNamespace(tinker_path="tinker://r/sampler_weights/s")]
    playground = routes.templates.get_template("playground.html").render(
        models=models, samplers=samplers, images=True
    )
    for page in (shell, playground):
        parsed = _Controls()
        parsed.feed(page)
        assert parsed.controls and set(parsed.controls) <= parsed.labels, parsed.controls
    assert re.search(r'<label for="api-key">API key</label>', shell)
    assert 'type="password"' in shell and 'autocomplete="off"' in shell


def test_the_bundle_is_small_and_fetches_nothing_from_elsewhere() -> None:
    files = [p for p in CONSOLE.rglob("*") if p.suffix in (".html", ".js", ".css")]
    assert {p.name for p in files} >= {"console.js", "console.css", "shell.html"}
    size = sum(p.stat().st_size for p in files)
    assert size < 300_000, f"the console's files weigh {size} bytes"
    for p in files:  # no CDN, no font or script from another host
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", p.read_text()), p
        assert "@import" not in p.read_text() and "url(http" not in p.read_text(), p
    assert set(routes.STATIC) == {p.name for p in (CONSOLE / "static").iterdir()}
    assert "script-src 'self'" in routes.HEADERS["Content-Security-Policy"]
