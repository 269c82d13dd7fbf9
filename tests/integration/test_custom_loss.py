"""Server-side custom losses through the real SDK against `lockstep serve`: create_custom_loss +
forward_backward_custom run in one clock cycle with the client-side path's numbers (a DPO-style
loss and an RL loss with KL and clipping), batch invariance, NaN failing only its own op in the
cycle it shares, the graphs too costly for a datum's pass refused at creation naming the node,
and a table of hostile graphs each refused with a 400 while the server keeps serving."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from tinker import types
from tinker.lib.public_interfaces.custom_loss import LossHandle, encode_graph, trace_loss

from tests.integration.conftest import API_KEY
from tests.unit.test_custom_loss import HOSTILE as COSTLY

pytestmark = pytest.mark.e2e

T = 12


def dpo(logprobs, chosen_mask, rejected_mask, ref_chosen, ref_rejected):  # type: ignore[no-untyped-def]
    """DPO on one datum holding both answers: the masks pick each answer's tokens, the ref_*
    scalars are the reference model's summed logprobs."""
    chosen = (logprobs * chosen_mask).sum() - ref_chosen
    rejected = (logprobs * rejected_mask).sum() - ref_rejected
    margin = 0.5 * (chosen - rejected)
    loss = -F.logsigmoid(margin)
    return loss, {"custom/margin:mean": margin, "custom/accuracy:mean": (chosen > rejected).float()}


def rl_kl_clip(logprobs, old_logprobs, ref_logprobs, advantages, mask):  # type: ignore[no-untyped-def]
    """PPO-clipped policy gradient plus a k3 KL penalty to a reference, averaged over the mask."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    pg = -torch.minimum(ratio * advantages, clipped * advantages)
    kl = torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1
    loss = ((pg + 0.1 * kl) * mask).sum() / mask.sum().clamp(min=1.0)
    clip_frac = ((ratio - clipped).abs() > 0).float().mean()
    return loss, {"custom/kl:sum": (kl * mask).sum(), "custom/clip_frac:mean": clip_frac}


def nan_loss(logprobs, weights):  # type: ignore[no-untyped-def]
    loss = torch.log(-(logprobs * weights).sum() - 1e9)  # log of a negative number
    return loss, {}


def huge_on_long_data(logprobs, weights):  # type: ignore[no-untyped-def]
    n = logprobs.size(0)
    big = logprobs.new_zeros(n, n, n)  # 64^3 at creation's probe; 200^3 costs too much
    return (logprobs * weights).sum() + big.sum(), {}


def _tokens(seed: int, n: int = T) -> list[int]:
    return [(7 * i + 3 * seed) % 900 + 20 for i in range(n + 1)]


def _datum(seed: int, n: int = T, **inputs: Any) -> types.Datum:
    tokens = _tokens(seed, n)
    arrays = {
        k: v if isinstance(v, types.TensorData) else np.asarray(v, np.float32)
        for k, v in inputs.items()
    }
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **arrays},
    )


def _dpo_data() -> list[types.Datum]:
    half = T // 2
    chosen = [0.0] * 2 + [1.0] * (half - 2) + [0.0] * half
    rejected = [0.0] * (half + 2) + [1.0] * (half - 2)
    return [
        _datum(
            s,
            chosen_mask=chosen,
            rejected_mask=rejected,
            ref_chosen=types.TensorData(data=[-30.0 - s], dtype="float32", shape=[]),
            ref_rejected=types.TensorData(data=[-28.0 + s], dtype="float32", shape=[]),
        )
        for s in range(3)
    ]


def _rl_data() -> list[types.Datum]:
    rng = np.random.default_rng(0)
    out = []
    for s in range(3):
        mask = [0.0] * 3 + [1.0] * (T - 3)
        out.append(
            _datum(
                s + 10,
                old_logprobs=(-7.0 + 0.3 * rng.standard_normal(T)).tolist(),
                ref_logprobs=(-7.0 + 0.3 * rng.standard_normal(T)).tolist(),
                advantages=rng.standard_normal(T).tolist(),
                mask=mask,
            )
        )
    return out


DPO_RANKS = {
    "logprobs": 1,
    "chosen_mask": 1,
    "rejected_mask": 1,
    "ref_chosen": 0,
    "ref_rejected": 0,
}
RL_RANKS = {"logprobs": 1, "old_logprobs": 1, "ref_logprobs": 1, "advantages": 1, "mask": 1}
# A huge eps makes one AdamW step ~ lr * g / eps: the new weights carry the gradient itself.
STEP = types.AdamParams(learning_rate=100.0, eps=100.0, beta1=0.0, beta2=0.0)


def _trainer(service_client: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    return service_client.create_lora_training_client(
        base_model=base_model, rank=4, seed=3
    ).result()


def _cycle(trainer: tinker.TrainingClient) -> int:
    out = trainer.forward([_datum(99, 4)], "cross_entropy").result()
    return int(out.metrics["clock_cycle:unique"])


def _logprobs(trainer: tinker.TrainingClient, data: list[types.Datum]) -> np.ndarray:
    out = trainer.forward(data, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


@pytest.fixture(scope="module")
def handles(service_client: tinker.ServiceClient) -> dict[str, LossHandle]:
    assert service_client.holder.get_client_config().custom_loss_server_side
    out = {}
    for fn, ranks in ((dpo, DPO_RANKS), (rl_kl_clip, RL_RANKS)):
        out[fn.__name__] = service_client.create_custom_loss(fn, ranks).result()
        assert out[fn.__name__].loss_id is not None  # uploaded: it runs on the server
    return out


@pytest.mark.parametrize(("name", "make_data"), [("dpo", _dpo_data), ("rl_kl_clip", _rl_data)])
def test_server_side_equals_client_side_in_half_the_cycles(
    service_client: tinker.ServiceClient,
    base_model: str,
    handles: dict[str, LossHandle],
    name: str,
    make_data: Any,
) -> None:
    data = make_data()
    server, client = _trainer(service_client, base_model), _trainer(service_client, base_model)
    cycles = {}
    results = {}
    for key, trainer, handle in (
        ("server", server, handles[name]),
        ("client", client, dataclasses.replace(handles[name], loss_id=None)),
    ):
        before = _cycle(trainer)
        results[key] = trainer.forward_backward_custom(data, handle).result()
        cycles[key] = _cycle(trainer) - before - 1  # the cycles between the two probes
        trainer.optim_step(STEP).result()
    assert cycles == {"server": 1, "client": 2}
    s, c = results["server"].metrics, results["client"].metrics
    assert s["loss:sum"] == pytest.approx(c["loss:sum"], abs=1e-5)
    for key in [k for k in c if k.startswith("custom/")]:
        assert s[key] == pytest.approx(c[key], abs=1e-5), key
    # Same gradients: one step of ~lr * g / eps moved both adapters to the same weights.
    after_server, after_client = _logprobs(server, data), _logprobs(client, data)
    base = _logprobs(_trainer(service_client, base_model), data)
    assert np.abs(after_server - base).max() > 1e-4  # the step did move the weights
    np.testing.assert_allclose(after_server, after_client, atol=1e-5, rtol=0)


def test_a_tenant_alone_equals_packed_and_nan_fails_only_its_own_op(
    service_client: tinker.ServiceClient, base_model: str, handles: dict[str, LossHandle]
) -> None:
    a, b, c = (_trainer(service_client, base_model) for _ in range(3))
    data = _rl_data()
    alone = a.forward_backward_custom(data, handles["rl_kl_clip"]).result()
    nan = service_client.create_custom_loss(nan_loss, {"logprobs": 1, "weights": 1}).result()
    # Whether the SDK's submissions land in one cycle depends on timing (the clock gathers 20 ms):
    # try a few times, check the numbers every time. tests/integration/
    # test_failures_cost_their_op.py puts a NaN tenant in the cycle of two others every time.
    for _ in range(5):
        futures = [
            a.forward_backward_custom(data, handles["rl_kl_clip"]),
            b.forward_backward_custom(_dpo_data(), handles["dpo"]),
            b.forward_backward(_dpo_data()[:1], "cross_entropy"),  # a built-in beside them
            c.forward_backward_custom([_datum(5, weights=[1.0] * T)], nan),
        ]
        packed, other = futures[0].result(), futures[2].result()
        with pytest.raises(tinker.RequestFailedError, match="nan|NaN|inf") as err:
            futures[3].result()
        assert "nan_loss" in str(err.value)
        assert packed.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], abs=1e-5)
        for key in ("custom/kl:sum", "custom/clip_frac:mean"):
            assert packed.metrics[key] == pytest.approx(alone.metrics[key], abs=1e-5)
        if packed.metrics["clock_cycle:unique"] == other.metrics["clock_cycle:unique"]:
            break
    np.testing.assert_allclose(
        packed.loss_fn_outputs[0]["logprobs"].to_numpy(),
        alone.loss_fn_outputs[0]["logprobs"].to_numpy(),
        atol=1e-5,
    )


# ---------------------------------------------------------------- hostile graphs


def _valid_graph() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def weighted(logprobs, weights):  # type: ignore[no-untyped-def]
        loss = -(logprobs * weights).sum()
        return loss, {"custom/nll:sum": loss}

    handle = trace_loss(weighted, {"logprobs": 1, "weights": 1}, "probe")
    nodes = [n.model_dump(mode="json") for n in encode_graph(handle).nodes]
    inputs = [x.model_dump(mode="json") for x in handle.inputs]
    return nodes, inputs


def _node(op: str, name: str, target: str, args: list[Any], **kwargs: Any) -> dict[str, Any]:
    return {"op": op, "name": name, "target": target, "args": args, "kwargs": kwargs}


def _insert(node: dict[str, Any]) -> Any:
    """A graph with `node` before the output, which returns it in place of the loss."""

    def edit(nodes: list[dict[str, Any]]) -> None:
        nodes.insert(-1, node)
        nodes[-1]["args"][0]["tuple"][0] = {"ref": node["name"]}

    return edit


def _deep(nodes: list[dict[str, Any]]) -> None:
    last = nodes[-2]["name"]
    for i in range(600):
        nodes.insert(-1, _node("call_function", f"n{i}", "operator.neg", [{"ref": last}]))
        last = f"n{i}"


def _mse_of_ones(nodes: list[dict[str, Any]]) -> None:
    ones = [
        _node("call_function", "a", "torch.ones", [20000, 1]),
        _node("call_function", "b", "torch.ones", [1, 20000]),
        _node("call_function", "x", "torch.nn.functional.mse_loss", [{"ref": "a"}, {"ref": "b"}]),
    ]
    _insert_all(nodes, ones)


def _einsum_of_ones(nodes: list[dict[str, Any]]) -> None:
    a = {"ref": "a"}
    chain = [_node("call_function", "a", "torch.ones", [2048, 2048])]
    last = "logprobs"
    for i in range(100):
        chain.append(_node("call_function", f"e{i}", "torch.einsum", ["ik,jk,ij->", a, a, a]))
        chain.append(
            _node("call_function", f"s{i}", "operator.add", [{"ref": last}, {"ref": f"e{i}"}])
        )
        last = f"s{i}"
    chain.append(_node("call_method", "x", "sum", [{"ref": last}]))
    _insert_all(nodes, chain)


def _insert_all(nodes: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """`new` before the output, which returns its last node in place of the loss."""
    for node in new:
        nodes.insert(-1, node)
    nodes[-1]["args"][0]["tuple"][0] = {"ref": new[-1]["name"]}


def _set(index: int, **fields: Any) -> Any:
    def edit(nodes: list[dict[str, Any]]) -> None:
        nodes[index].update(fields)

    return edit


def _metric(key: str) -> Any:
    def edit(nodes: list[dict[str, Any]]) -> None:
        nodes[-1]["args"][0]["tuple"][1] = {"dict": {key: {"ref": nodes[-2]["name"]}}}

    return edit


L = {"ref": "logprobs"}
SENTINEL = "/tmp/lockstep-custom-loss-was-executed"
HOSTILE: dict[str, Any] = {
    "os.system": _insert(_node("call_function", "x", "os.system", [f"touch {SENTINEL}"])),
    "builtins.eval": _insert(
        _node("call_function", "x", "builtins.eval", [f"open('{SENTINEL}', 'w')"])
    ),
    "eval": _insert(_node("call_function", "x", "eval", ["1"])),
    "torch.load": _insert(_node("call_function", "x", "torch.load", ["/etc/passwd"])),
    "torch.save": _insert(_node("call_function", "x", "torch.save", [L, SENTINEL])),
    "__import__": _insert(_node("call_function", "x", "builtins.__import__", ["os"])),
    "bare __import__": _insert(_node("call_function", "x", "__import__", ["os"])),
    "attribute chain": _insert(_node("call_function", "x", "torch.exp.__globals__.get", ["os"])),
    "getattr dunder": _insert(_node("call_function", "x", "getattr", [L, "__class__"])),
    "method __reduce_ex__": _insert(_node("call_method", "x", "__reduce_ex__", [L, 2])),
    "method item (host)": _insert(_node("call_method", "x", "item", [L])),
    "in-place method": _insert(_node("call_method", "x", "exp_", [L])),
    "call_module": _insert(_node("call_module", "x", "linear", [L])),
    "get_attr": _insert(_node("get_attr", "x", "_tensor_constant0", [])),
    "uninitialised memory": _insert(_node("call_function", "x", "torch.empty", [10])),
    "huge torch.ones": _insert(_node("call_function", "x", "torch.ones", [100000, 100000])),
    "huge expand": _insert(_node("call_method", "x", "expand", [L, 1 << 20, 1 << 20])),
    "huge arange": _insert(_node("call_function", "x", "torch.arange", [1 << 40])),
    "huge python power": _insert(_node("call_function", "x", "operator.pow", [10, 10**9])),
    # The issue's graphs as posted (raw JSON, not through the SDK's tracer).
    "literal index list past the data": _insert(
        _node("call_function", "x", "operator.getitem", [L, [100000]])
    ),
    "out= into an input": _insert(
        _node("call_function", "x", "torch.mul", [{"ref": "weights"}, 0], out={"ref": "weights"})
    ),
    "mse_loss of literal ones": _mse_of_ones,
    "einsum of literal ones": _einsum_of_ones,
    "python division by zero": _insert(_node("call_function", "x", "operator.truediv", [1, 0])),
    "deep graph": _deep,
    "self reference": _insert(_node("call_function", "x", "operator.neg", [{"ref": "x"}])),
    "forward reference": _set(2, args=[{"ref": "output"}]),
    "unknown reference": _insert(_node("call_function", "x", "torch.exp", [{"ref": "nope"}])),
    "unknown node op": _insert(_node("call_python", "x", "torch.exp", [L])),
    "unknown encoding": _insert(_node("call_function", "x", "torch.exp", [{"code": "1"}])),
    "bad dtype": _insert(
        _node("call_function", "x", "torch.zeros", [3], dtype={"dtype": "object"})
    ),
    "non-scalar loss": _insert(_node("call_function", "x", "torch.exp", [L])),
    "metric outside custom/": _metric("loss:sum"),
    "metric uppercase": _metric("custom/Loss:sum"),
    "placeholder not declared": _set(1, target="advantages"),
    "output not last": lambda nodes: nodes.append(copy.deepcopy(nodes[-2])),
}


@pytest.fixture(scope="module")
def http(server: Any, service_client: tinker.ServiceClient) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"X-API-Key": API_KEY}, timeout=60)


def _create(http: httpx.Client, session_id: str, seq: int, nodes: list, inputs: list) -> Any:
    body = {
        "session_id": session_id,
        "custom_loss_seq_id": seq,
        "name": "hostile",
        "inputs": inputs,
        "graph": {"format": 1, "nodes": nodes},
    }
    return http.post("/api/v1/create_custom_loss", json=body)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_graphs_are_refused_at_creation(
    http: httpx.Client, service_client: tinker.ServiceClient, case: str
) -> None:
    nodes, inputs = _valid_graph()
    HOSTILE[case](nodes)
    seq = 1000 + sorted(HOSTILE).index(case)
    reply = _create(http, service_client.holder.get_session_id(), seq, nodes, inputs)
    assert reply.status_code == 400, (case, reply.status_code, reply.text)
    detail = reply.json()["detail"]
    assert "graph" in detail or "node" in detail, detail
    assert not Path(SENTINEL).exists()
    assert http.get("/api/v1/healthz").status_code == 200


def test_the_valid_graph_is_accepted_and_retries_are_idempotent(
    http: httpx.Client, service_client: tinker.ServiceClient
) -> None:
    nodes, inputs = _valid_graph()
    session = service_client.holder.get_session_id()
    first = _create(http, session, 2000, nodes, inputs)
    again = _create(http, session, 2000, nodes, inputs)
    assert first.status_code == again.status_code == 200, first.text
    ids = {
        http.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}).json()[
            "loss_id"
        ]
        for r in (first, again)
    }
    assert len(ids) == 1
    other = copy.deepcopy(nodes)
    _metric("custom/other:mean")(other)
    conflict = _create(http, session, 2000, other, inputs)
    assert conflict.status_code == 400 and "custom_loss_seq_id" in conflict.json()["detail"]


def test_bad_data_for_a_loss_is_refused_at_submission(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainer = _trainer(service_client, base_model)
    huge = service_client.create_custom_loss(
        huge_on_long_data, {"logprobs": 1, "weights": 1}
    ).result()
    assert huge.loss_id is not None
    cases = {
        "rank": [_datum(1, weights=[[1.0]] * T)],  # declared rank 1, sent [T, 1]
        "missing": [_datum(1)],
        "size": [_datum(1, n=200, weights=[1.0] * 200)],
    }
    for case, data in cases.items():
        with pytest.raises(tinker.BadRequestError) as err:
            trainer.forward_backward(data, "custom", {"loss_id": huge.loss_id}).result()
        assert "weights" in str(err.value) or "FLOPs" in str(err.value), (case, err.value)
    with pytest.raises(tinker.BadRequestError, match="loss_id"):
        trainer.forward_backward([_datum(1)], "custom", {"loss_id": "someone-else:loss:0"}).result()
    # The model's later requests still run.
    out = trainer.forward_backward(
        [_datum(1, n=8, weights=[1.0] * 8)], "custom", {"loss_id": huge.loss_id}
    )
    assert math.isfinite(out.result().metrics["loss:sum"])


@pytest.mark.parametrize("case", sorted(COSTLY))
def test_the_issues_graphs_are_refused_at_creation_through_the_sdk(
    service_client: tinker.ServiceClient, http: httpx.Client, case: str
) -> None:
    fn, node, says = COSTLY[case]
    with pytest.raises(tinker.BadRequestError) as refused:
        service_client.create_custom_loss(fn, {"logprobs": 1, "weights": 1}).result()
    assert "graph.nodes[" in str(refused.value) and f"'{node}" in str(refused.value)
    assert says in str(refused.value)
    assert http.get("/api/v1/healthz").status_code == 200


def test_get_info_and_capabilities_report_the_cost_bound(
    http: httpx.Client, service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainer = _trainer(service_client, base_model)
    info = http.post("/api/v1/get_info", json={"model_id": trainer.model_id}).json()
    caps = http.get("/api/v1/get_server_capabilities").json()["supported_models"][0]
    for reported in (info, caps):
        assert reported["custom_loss_max_flops_per_token"] >= 1 << 16
        assert reported["custom_loss_max_memory_bytes"] > 0
