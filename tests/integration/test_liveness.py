"""Liveness through the real SDK: a request the scheduler refuses never holds up the model's
later requests (it keeps its seq_id as a failed op, and progress only moves forward).

The server here gathers for 0.5 s before a cycle, so a burst the SDK sends at once (refused pass,
good pass, optim_step) lands in ONE cycle every time: the case that used to hang, made certain.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from tinker import types

from lockstep.devserver import start_server, stop_server

from .conftest import API_KEY

pytestmark = pytest.mark.e2e
ADAM = types.AdamParams(learning_rate=1e-3)
BAD_TOKEN = 10**8  # far beyond any vocabulary: refused at submission with a 400


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )


@pytest.fixture(scope="module")
def service_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    data: Path = tmp_path_factory.mktemp("liveness") / "data"
    server = start_server(data, "--clock-gather", "0.5")
    yield tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    assert stop_server(server) == 0, server.log()[-3000:]


GOOD = _datum([5, 6, 7, 8, 9, 10])
BAD = _datum([5, 6, BAD_TOKEN, 8])


def _refused(future: tinker.APIFuture) -> str:  # type: ignore[type-arg]
    with pytest.raises(Exception) as info:
        future.result(timeout=120)
    return str(info.value)


def test_a_refused_pass_then_a_pipelined_step_completes(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    """The reported hang: refused forward_backward (seq k), then at once a good one (k+1) and
    optim_step (k+2). The step used to wait forever (next_seq written back to k+1)."""
    trainer = service_client.create_lora_training_client(base_model=base_model, rank=4).result()
    bad = trainer.forward_backward([BAD], "cross_entropy")
    good = trainer.forward_backward([GOOD], "cross_entropy")
    step = trainer.optim_step(ADAM)
    assert "token" in _refused(bad)
    first = good.result(timeout=120).metrics["loss:sum"]
    step.result(timeout=120)
    # The model keeps training, pipelined, with more refusals mixed in.
    futures = []
    for i in range(4):
        if i % 2:
            futures.append(("bad", trainer.forward_backward([BAD], "cross_entropy")))
        futures.append(("fb", trainer.forward_backward([GOOD], "cross_entropy")))
        futures.append(("step", trainer.optim_step(ADAM)))
    losses = []
    for kind, future in futures:
        if kind == "bad":
            assert "token" in _refused(future)
        elif kind == "fb":
            losses.append(future.result(timeout=120).metrics["loss:sum"])
        else:
            future.result(timeout=120)
    assert losses[-1] < first, (first, losses)  # the steps were applied
    sampler = trainer.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2, temperature=0)
    ).result(timeout=120)
    assert len(out.sequences[0].tokens) == 2
