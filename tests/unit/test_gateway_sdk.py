"""The unmodified tinker SDK 0.38 against the gateway (real uvicorn, real HTTP), with a test
stand-in for the scheduler behind it that answers every job at once.

This checks the wire, not training: the SDK's own request encoding, its response validation
and its protobuf decoding all pass through the gateway. The real scheduler is covered by the
end-to-end tests.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tinker
import uvicorn
from tinker import types

from lockstep.gateway.app import create_app
from lockstep.gateway.settings import GatewaySettings
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2
from tests.scheduler_standin import TEST_API_KEY, StandInScheduler, running_standin

SESSION = "sess-1"
MODEL = f"{SESSION}:train:0"
BASE = "Qwen/Qwen3-0.6B"


def _fwd_bwd_output(req: tinker_pb2.ForwardBackwardRequest) -> tinker_pb2.ForwardBackwardOutput:
    """Per-datum logprobs shaped like target_tokens (all -1.0), and the required `loss:sum`."""
    arrays = []
    for datum in req.data:
        n = len(datum.loss_fn_inputs["target_tokens"].dense) // 8
        arrays.append(np.full(n, -1.0, dtype="<f4"))
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    out = tinker_pb2.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        metrics={"loss:sum": float(sum(a.size for a in arrays)), "clock_cycle:unique": 1.0},
    )
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(arrays))
    record.fields["logprobs"].CopyFrom(
        tinker_pb2.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays),
            offsets=offsets.tobytes(),
            dtype=tinker_pb2.DTYPE_FLOAT32,
        )
    )
    return out


def _sample_output(op: pb.Sample) -> tinker_pb2.SampleResponse:
    resp = tinker_pb2.SampleResponse()
    n = op.params.max_tokens or 4
    for _ in range(op.num_samples):
        resp.sequences.add(
            stop_reason=tinker_pb2.STOP_REASON_LENGTH,
            tokens=np.arange(n, dtype="<i4").tobytes(),
            logprobs=np.full(n, -0.5, dtype="<f4").tobytes(),
        )
    return resp


class InstantJobs:
    """Stand-in scheduler replies: every submitted job is done by the time it is polled."""

    def __init__(self) -> None:
        self.jobs: dict[str, pb.SubmitRequest] = {}
        self.ids = itertools.count()

    def submit(self, req: pb.SubmitRequest) -> pb.SubmitReply:
        request_id = f"req-{next(self.ids)}"
        self.jobs[request_id] = req
        reply = pb.SubmitReply(request_id=request_id)
        if req.WhichOneof("op") == "sample":
            reply.sample_sequence_ids.extend(
                f"{request_id}:seq:{i}" for i in range(req.sample.num_samples)
            )
        return reply

    def retrieve(self, req: pb.RetrieveFutureRequest) -> pb.FutureReply:
        job = self.jobs[req.request_id]
        op = job.WhichOneof("op")
        result = pb.JobResult()
        if op == "create_model":
            result.create_model.model_id = MODEL
        elif op == "forward_backward":
            result.forward_backward.CopyFrom(_fwd_bwd_output(job.forward_backward))
        elif op == "optim_step":
            result.optim_step.metrics["learning_rate:mean"] = job.optim_step.adam.learning_rate
        elif op == "save_weights" and job.save_weights.HasField("name"):
            segment = {pb.CHECKPOINT_KIND_TRAINING: "weights"}.get(
                job.save_weights.kind, "sampler_weights"
            )
            result.save.path = f"tinker://{MODEL}/{segment}/{job.save_weights.name}"
        elif op == "save_weights":
            seq = job.save_weights.sampling_session_seq_id
            result.save.sampling_session_id = f"{SESSION}:sample:{seq}"
        elif op == "sample":
            result.sample.CopyFrom(_sample_output(job.sample))
        return pb.FutureReply(result=result)

    def retrieve_futures(self, req: pb.RetrieveFuturesRequest) -> pb.RetrieveFuturesReply:
        """The SDK's session poller: every sample of the (sampling session, clone) is done, so
        the completions after the cursor are all of those submitted after it."""
        done = [
            request_id
            for request_id, job in self.jobs.items()
            if job.WhichOneof("op") == "sample"
            and job.sample.sampling_session_id == req.sampler_id
            and job.sample.seq_id // 1_000_000_000 == req.clone
        ]
        return pb.RetrieveFuturesReply(
            completions=[
                pb.FutureCompletion(request_id=request_id, payload_size=1)
                for request_id in done[req.prev_cursor :]
            ],
            cursor=len(done),
        )


@pytest.fixture(scope="module")
def gateway_url() -> Iterator[tuple[StandInScheduler, str]]:
    with running_standin() as (standin, address):
        settings = GatewaySettings(
            scheduler_address=address, api_keys=frozenset({TEST_API_KEY}), long_poll_seconds=2.0
        )
        server = uvicorn.Server(
            uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield standin, f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=10)


def test_sdk_training_and_sampling_flow(
    gateway_url: tuple[StandInScheduler, str], monkeypatch: Any
) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    standin, url = gateway_url
    standin.reset()
    jobs = InstantJobs()
    standin.replies["Submit"] = jobs.submit
    standin.replies["RetrieveFuture"] = jobs.retrieve
    standin.replies["RetrieveFutures"] = jobs.retrieve_futures
    standin.replies["CreateSession"] = pb.CreateSessionReply(session_id=SESSION)
    standin.replies["GetModelInfo"] = pb.ModelInfo(model_id=MODEL, base_model=BASE, lora_rank=8)
    standin.replies["ListCheckpoints"] = pb.CheckpointList(
        checkpoints=[
            pb.Checkpoint(
                checkpoint_id="weights/ckpt-1",
                checkpoint_type="training",
                time=time.time(),
                tinker_path=f"tinker://{MODEL}/weights/ckpt-1",
            )
        ],
        total_count=1,
    )

    with tinker.ServiceClient(base_url=url, api_key=TEST_API_KEY) as service:
        training = service.create_lora_training_client(base_model=BASE, rank=8).result()
        assert training.get_info().model_data.model_name == BASE
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
            loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 0.0]},
        )
        fwd_bwd = training.forward_backward([datum, datum], "cross_entropy").result()
        assert fwd_bwd.metrics["loss:sum"] == 8.0
        assert fwd_bwd.loss_fn_outputs[1]["logprobs"].tolist() == [-1.0] * 4
        optim = training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        assert optim.metrics == {"learning_rate:mean": pytest.approx(1e-4)}
        saved = training.save_state("ckpt-1").result()
        assert saved.path == f"tinker://{MODEL}/weights/ckpt-1"

        sampler = training.save_weights_and_get_sampling_client().result()
        sample = sampler.sample(
            types.ModelInput.from_ints([1, 2, 3]),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=3, temperature=0.7),
        ).result()
        assert [s.tokens for s in sample.sequences] == [[0, 1, 2], [0, 1, 2]]
        assert sample.sequences[0].logprobs == [-0.5] * 3

    rest = tinker.RestClient(base_url=url, api_key=TEST_API_KEY)
    listing = rest.list_checkpoints(MODEL).result()
    assert listing.checkpoints[0].checkpoint_id == "weights/ckpt-1"

    ops = [standin_job.WhichOneof("op") for standin_job in jobs.jobs.values()]
    assert ops == [
        "create_model",
        "forward_backward",
        "optim_step",
        "save_weights",
        "save_weights",
        "sample",
    ]
    seq_ids = [
        j.forward_backward.seq_id for j in jobs.jobs.values() if j.HasField("forward_backward")
    ]
    assert seq_ids == [1]
    assert standin.requests("FinishSession")


def test_cli_downloads_external_weights_through_signed_urls(
    gateway_url: tuple[StandInScheduler, str], tmp_path: Any
) -> None:
    """`tinker checkpoint download` fetches the signed URLs with no API key."""
    standin, url = gateway_url
    standin.reset()
    source = tmp_path / "store"
    source.mkdir()
    (source / "adapter_config.json").write_text('{"r": 8}')
    (source / "adapter_model.safetensors").write_bytes(b"\0" * 4096)
    standin.replies["GetCheckpointFiles"] = pb.CheckpointFiles(
        directory=str(source),
        relative_paths=["adapter_config.json", "adapter_model.safetensors"],
        expires=time.time() + 3600,
    )
    out = tmp_path / "out"
    env = {
        **os.environ,
        "TINKER_BASE_URL": url,
        "TINKER_API_KEY": TEST_API_KEY,
        "TINKER_TELEMETRY": "0",
        "HOME": str(tmp_path),
    }
    path = f"tinker://{MODEL}/external_weights/exp1"
    cli = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", path, "-o", str(out)]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    target = out / f"{MODEL}_external_weights_exp1"
    assert (target / "adapter_config.json").read_text() == '{"r": 8}'
    assert (target / "adapter_model.safetensors").stat().st_size == 4096
    assert standin.last("GetCheckpointFiles").tinker_path == path
