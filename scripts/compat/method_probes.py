"""One probe per public SDK client method: call it for real, check the result."""

import datetime as dt
import os
from typing import Any

from compat.context import API_KEY, Caller, ClientSide, Ctx, expect, probe

# ServiceClient ---------------------------------------------------------------------------


@probe("ServiceClient.create_lora_training_client")
def _(c: Ctx, call: Caller) -> str | None:
    tc = call(
        c.service,
        "create_lora_training_client",
        base_model=c.base_model,
        rank=4,
        seed=1,
        user_metadata={"k": "v"},
    )
    expect(tc.model_id.startswith("sess-"), "model id")
    return "rank, seed, train_mlp/attn/unembed, user_metadata"


@probe("ServiceClient.create_sampling_client")
def _(c: Ctx, call: Caller) -> str | None:
    base = call(c.service, "create_sampling_client", base_model=c.base_model)
    tuned = call(c.service, "create_sampling_client", model_path=c.sampler_path)
    both = call(
        c.service,
        "create_sampling_client",
        base_model=c.base_model,
        model_path=c.sampler_path,
        record_stability_info=True,
    )
    for s in (base, tuned, both):
        expect(len(s.compute_logprobs(c.prompt()).result()) == 6, "logprobs")
    return "base_model=, model_path=, both (KL references), record_stability_info"


@probe("ServiceClient.create_training_client_from_state")
def _(c: Ctx, call: Caller) -> str | None:
    tc = call(
        c.service,
        "create_training_client_from_state",
        c.state_path,
        user_metadata={"renderer_name": "role_colon"},
    )
    expect(tc.model_id != c.run_id, "a new run")
    return "weights only; a fresh optimizer"


@probe("ServiceClient.create_training_client_from_state_with_optimizer")
def _(c: Ctx, call: Caller) -> str | None:
    tc = call(c.service, "create_training_client_from_state_with_optimizer", c.state_path)
    expect(tc.get_info().model_data is not None, "info")
    return "weights and Adam state"


@probe("ServiceClient.get_server_capabilities")
def _(c: Ctx, call: Caller) -> str | None:
    caps = call(c.service, "get_server_capabilities")
    names = [m.model_name for m in caps.supported_models]
    expect(c.base_model in names, f"{c.base_model} in {names}")
    return "lists every served name (aliases included)"


@probe("ServiceClient.create_rest_client")
def _(c: Ctx, call: Caller) -> str | None:
    raise ClientSide("builds a RestClient; no request")


@probe("ServiceClient.get_console_url", "TrainingClient.get_console_url")
def _(c: Ctx, call: Caller) -> str | None:
    raise ClientSide("a link into the hosted Tinker console; meaningless for a self-hosted server")


@probe(
    "ServiceClient.get_telemetry",
    "TrainingClient.get_telemetry",
    "SamplingClient.get_telemetry",
    "RestClient.get_telemetry",
)
def _(c: Ctx, call: Caller) -> str | None:
    raise ClientSide("the SDK's telemetry sink (POST /telemetry is accepted and dropped)")


@probe("ServiceClient.close")
def _(c: Ctx, call: Caller) -> str | None:
    import tinker

    sc = tinker.ServiceClient(base_url=c.base_url, api_key=API_KEY)
    sc.create_lora_training_client(base_model=c.base_model, rank=4).result()
    call(sc, "close", "success")
    return "marks the session finished"


@probe("ServiceClient.copy_weights", "RestClient.copy_weights")
def _(c: Ctx, call: Caller) -> str | None:
    if call.cls_name == "RestClient":
        path = call(c.rest, "copy_weights", c.sampler_path, "project-1")
    else:
        os.environ["TINKER_PROJECT_ID"] = "project-1"
        try:
            path = call(c.service, "copy_weights", c.sampler_path)
        finally:
            del os.environ["TINKER_PROJECT_ID"]
    expect(str(path).startswith("tinker://"), str(path))
    return None


def weighted_nll(logprobs: Any, weights: Any) -> Any:
    """A per-datum custom loss for create_custom_loss (traced by torch.fx)."""
    return -(logprobs * weights).sum(), {}


@probe("ServiceClient.create_custom_loss")
def _(c: Ctx, call: Caller) -> str | None:
    handle = call(c.service, "create_custom_loss", weighted_nll, {"logprobs": 1, "weights": 1})
    expect(handle.loss_id is not None, "the loss was not uploaded")
    out = c.shared_trainer.forward_backward_custom([c.datum(weights=[1.0] * 8)], handle).result()
    expect("loss:sum" in out.metrics and "surrogate_loss:sum" not in out.metrics, str(out.metrics))
    return (
        "uploaded (custom_loss_server_side=true): forward_backward_custom runs it on the "
        "server in one forward_backward"
    )


# TrainingClient --------------------------------------------------------------------------


@probe("TrainingClient.forward")
def _(c: Ctx, call: Caller) -> str | None:
    out = call(c.shared_trainer, "forward", [c.datum()], "cross_entropy")
    expect(out.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (8,), "logprobs")
    return "forward only (no gradient)"


@probe("TrainingClient.forward_backward")
def _(c: Ctx, call: Caller) -> str | None:
    out = call(c.shared_trainer, "forward_backward", [c.datum()], "cross_entropy")
    expect({"loss:sum", "clock_cycle:unique"} <= set(out.metrics), str(out.metrics))
    return "see the loss table below"


@probe("TrainingClient.forward_backward_custom")
def _(c: Ctx, call: Caller) -> str | None:
    def loss(data: Any, logprobs: list[Any]) -> Any:
        return sum((lp * lp).sum() for lp in logprobs), {"custom": 1.0}

    out = call(c.shared_trainer, "forward_backward_custom", [c.datum()], loss)
    expect({"loss:sum", "surrogate_loss:sum", "custom"} <= set(out.metrics), str(out.metrics))
    return "forward, then cross_entropy backward with any real (also negative) weights"


@probe("TrainingClient.optim_step")
def _(c: Ctx, call: Caller) -> str | None:
    from tinker import types

    tc = c.trainer()
    tc.forward_backward([c.datum()], "cross_entropy").result()
    out = call(tc, "optim_step", types.AdamParams(learning_rate=1e-3, beta2=0.95))
    expect("grad_norm:mean" in (out.metrics or {}), str(out.metrics))
    return "Adam (lr, betas, eps, weight_decay); metrics grad_norm, learning_rate, step"


@probe("TrainingClient.get_info")
def _(c: Ctx, call: Caller) -> str | None:
    info = call(c.shared_trainer, "get_info")
    expect(bool(info.model_data.tokenizer_id), "tokenizer_id")
    return "tokenizer_id is the local model directory"


@probe("TrainingClient.get_tokenizer")
def _(c: Ctx, call: Caller) -> str | None:
    tok = c.shared_trainer.get_tokenizer()
    expect(len(tok.encode("hello")) > 0, "encode")
    return "loads get_info().model_data.tokenizer_id: works offline"


@probe("TrainingClient.save_state")
def _(c: Ctx, call: Caller) -> str | None:
    out = call(c.shared_trainer, "save_state", c.name("state"), ttl_seconds=3600)
    expect(out.path.startswith("tinker://"), out.path)
    return "ttl_seconds, user_metadata"


@probe("TrainingClient.save_weights_for_sampler")
def _(c: Ctx, call: Caller) -> str | None:
    out = call(c.shared_trainer, "save_weights_for_sampler", c.name("sampler"), ttl_seconds=3600)
    expect(out.path.startswith("tinker://"), out.path)
    return "PEFT adapter directory"


@probe("TrainingClient.save_weights_external")
def _(c: Ctx, call: Caller) -> str | None:
    out = call(c.shared_trainer, "save_weights_external", c.name("external"))
    expect("external_weights" in out.path, out.path)
    return "downloadable PEFT adapter (signed URLs)"


@probe("TrainingClient.save_weights_and_get_sampling_client")
def _(c: Ctx, call: Caller) -> str | None:
    s = call(c.shared_trainer, "save_weights_and_get_sampling_client", record_stability_info=True)
    expect(len(s.compute_logprobs(c.prompt()).result()) == 6, "logprobs")
    return "record_stability_info accepted"


@probe("TrainingClient.create_sampling_client")
def _(c: Ctx, call: Caller) -> str | None:
    s = call(c.shared_trainer, "create_sampling_client", c.sampler_path)
    expect(len(s.compute_logprobs(c.prompt()).result()) == 6, "logprobs")
    return None


@probe("TrainingClient.load_state")
def _(c: Ctx, call: Caller) -> str | None:
    call(c.trainer(), "load_state", c.state_path)
    return "deprecated by the SDK; works"


@probe("TrainingClient.load_state_with_optimizer")
def _(c: Ctx, call: Caller) -> str | None:
    call(c.trainer(), "load_state_with_optimizer", c.state_path)
    return "deprecated by the SDK; works"


# SamplingClient --------------------------------------------------------------------------


@probe("SamplingClient.sample")
def _(c: Ctx, call: Caller) -> str | None:
    from tinker import types

    out = call(
        c.sampler,
        "sample",
        c.prompt(),
        2,
        types.SamplingParams(max_tokens=4, temperature=1.0, stop=["\n"]),
    )
    expect(len(out.sequences) == 2 and all(s.logprobs for s in out.sequences), "sequences")
    expect(all(s.sequence_id for s in out.sequences), "sequence ids")
    return "see the sampling table below"


@probe("SamplingClient.compute_logprobs")
def _(c: Ctx, call: Caller) -> str | None:
    lps = call(c.sampler, "compute_logprobs", c.prompt())
    expect(lps[0] is None and len(lps) == 6, str(lps))
    return None


@probe("SamplingClient.get_base_model")
def _(c: Ctx, call: Caller) -> str | None:
    expect(call(c.sampler, "get_base_model") == c.base_model, "base model")
    return None


@probe("SamplingClient.get_tokenizer")
def _(c: Ctx, call: Caller) -> str | None:
    # The SDK guesses the tokenizer from the base model's name (hub id), without asking the
    # server; a sampler created on the local directory path loads offline.
    s = c.service.create_sampling_client(
        base_model=c.shared_trainer.get_info().model_data.tokenizer_id
    ).result()
    expect(len(s.get_tokenizer().encode("hi")) > 0, "encode")
    raise ClientSide(
        "loads a tokenizer named after the base model (hub id or local path); "
        "works offline when the sampler was created with the model directory as "
        "base_model"
    )


@probe("SamplingClient.create")
def _(c: Ctx, call: Caller) -> str | None:
    import tinker

    s = tinker.SamplingClient.create(c.service.holder, base_model=c.base_model).result()
    expect(len(s.compute_logprobs(c.prompt()).result()) == 6, "logprobs")
    return "the constructor behind create_sampling_client"


@probe("SamplingClient.get_sampler_handle", "SamplingClient.from_sampler_handle")
def _(c: Ctx, call: Caller) -> str | None:
    import tinker

    handle = c.sampler.get_sampler_handle()
    s = tinker.SamplingClient.from_sampler_handle(handle, api_key=API_KEY)
    expect(len(s.compute_logprobs(c.prompt()).result()) == 6, "logprobs")
    return "a handle re-opens the sampler in another process"


@probe("SamplingClient.on_queue_state_change")
def _(c: Ctx, call: Caller) -> str | None:
    raise ClientSide("the SDK's hook for try_again queue states (logs paused_capacity reasons)")


# RestClient ------------------------------------------------------------------------------


@probe("RestClient.get_server_capabilities")
def _(c: Ctx, call: Caller) -> str | None:
    expect(bool(call(c.rest, "get_server_capabilities").supported_models), "models")
    return None


@probe("RestClient.get_training_run")
def _(c: Ctx, call: Caller) -> str | None:
    run = call(c.rest, "get_training_run", c.run_id)
    expect(run.training_run_id == c.run_id and run.lora_rank == 4, str(run))
    return None


@probe("RestClient.get_training_run_by_tinker_path")
def _(c: Ctx, call: Caller) -> str | None:
    tc = c.service.create_lora_training_client(
        base_model=c.base_model, rank=4, user_metadata={"renderer_name": "role_colon"}
    ).result()
    path = tc.save_state("meta").result().path
    run = call(c.rest, "get_training_run_by_tinker_path", path)
    expect((run.user_metadata or {}).get("renderer_name") == "role_colon", str(run))
    return "user_metadata round-trips (the cookbook's renderer check)"


@probe("RestClient.get_weights_info_by_tinker_path")
def _(c: Ctx, call: Caller) -> str | None:
    info = call(c.rest, "get_weights_info_by_tinker_path", c.state_path)
    expect(info.base_model == c.base_model, str(info))
    return None


@probe("RestClient.list_training_runs")
def _(c: Ctx, call: Caller) -> str | None:
    runs = call(c.rest, "list_training_runs", limit=100)
    expect(c.run_id in {r.training_run_id for r in runs.training_runs}, "listed")
    return None


@probe("RestClient.list_checkpoints")
def _(c: Ctx, call: Caller) -> str | None:
    paths = {x.tinker_path for x in call(c.rest, "list_checkpoints", c.run_id).checkpoints}
    expect({c.state_path, c.sampler_path} <= paths, str(paths))
    return None


@probe("RestClient.list_user_checkpoints")
def _(c: Ctx, call: Caller) -> str | None:
    paths = {x.tinker_path for x in call(c.rest, "list_user_checkpoints", limit=1000).checkpoints}
    expect(c.state_path in paths, "listed")
    return None


@probe("RestClient.delete_checkpoint")
def _(c: Ctx, call: Caller) -> str | None:
    name = c.name("doomed")
    c.shared_trainer.save_state(name).result()
    call(c.rest, "delete_checkpoint", c.run_id, f"weights/{name}")
    return None


@probe("RestClient.delete_checkpoint_from_tinker_path")
def _(c: Ctx, call: Caller) -> str | None:
    path = c.shared_trainer.save_state(c.name("doomed")).result().path
    call(c.rest, "delete_checkpoint_from_tinker_path", path)
    paths = {x.tinker_path for x in c.rest.list_checkpoints(c.run_id).result().checkpoints}
    expect(path not in paths, "deleted")
    return "the cookbook's rolling checkpoints"


@probe("RestClient.publish_checkpoint_from_tinker_path")
def _(c: Ctx, call: Caller) -> str | None:
    path = c.shared_trainer.save_weights_for_sampler(c.name("public")).result().path
    call(c.rest, "publish_checkpoint_from_tinker_path", path)
    s = c.other.create_sampling_client(model_path=path).result()  # another tenant may use it
    expect(len(s.compute_logprobs(c.prompt()).result()) == 6, "logprobs")
    return "other API keys can then sample / load it"


@probe("RestClient.unpublish_checkpoint_from_tinker_path")
def _(c: Ctx, call: Caller) -> str | None:
    import tinker

    path = c.shared_trainer.save_weights_for_sampler(c.name("public")).result().path
    c.rest.publish_checkpoint_from_tinker_path(path).result()
    call(c.rest, "unpublish_checkpoint_from_tinker_path", path)
    try:
        c.other.create_sampling_client(model_path=path).result()
    except tinker.NotFoundError:
        return None
    raise AssertionError("still public")


@probe("RestClient.set_checkpoint_ttl_from_tinker_path")
def _(c: Ctx, call: Caller) -> str | None:
    path = c.shared_trainer.save_state(c.name("ttl")).result().path
    call(c.rest, "set_checkpoint_ttl_from_tinker_path", path, 3600)
    listed = {x.tinker_path: x for x in c.rest.list_checkpoints(c.run_id).result().checkpoints}
    expect(listed[path].expires_at is not None, "expires_at")
    call(c.rest, "set_checkpoint_ttl_from_tinker_path", path, None)
    return "expired checkpoints disappear and their files are removed"


@probe("RestClient.get_external_weights_urls")
def _(c: Ctx, call: Caller) -> str | None:
    path = c.shared_trainer.save_weights_external(c.name("ext")).result().path
    urls = call(c.rest, "get_external_weights_urls", path)
    expect(bool(urls), str(urls))
    return "HMAC-signed, expiring URLs served by the gateway (`tinker checkpoint download`)"


@probe("RestClient.get_sampler")
def _(c: Ctx, call: Caller) -> str | None:
    s = c.service.create_sampling_client(model_path=c.sampler_path).result()
    sampler_id = s.get_sampler_handle() and s._sampling_session_id  # noqa: SLF001
    info = call(c.rest, "get_sampler", sampler_id)
    expect(info.model_path == c.sampler_path, str(info))
    return None


@probe("RestClient.get_session")
def _(c: Ctx, call: Caller) -> str | None:
    session_id = c.service.holder.get_session_id()
    expect(call(c.rest, "get_session", session_id) is not None, "session")
    return None


@probe("RestClient.list_sessions")
def _(c: Ctx, call: Caller) -> str | None:
    session_id = c.service.holder.get_session_id()
    out = call(c.rest, "list_sessions", limit=100)
    expect(session_id in str(out), "listed")
    return None


@probe("RestClient.search_sessions")
def _(c: Ctx, call: Caller) -> str | None:
    from tinker import types

    page = call(c.rest, "search_sessions", types.SessionSearchRequest())
    expect(c.service.holder.get_session_id() in [s.session_id for s in page.sessions], "found")
    return "the caller's own sessions; session_id, display_name, user_metadata, statuses, cursor"


@probe("RestClient.export_session_trace")
def _(c: Ctx, call: Caller) -> str | None:
    import json
    import urllib.request

    url = call(c.rest, "export_session_trace", c.service.holder.get_session_id())
    with urllib.request.urlopen(url, timeout=60) as response:  # signed: no auth header
        events = json.loads(response.read())["traceEvents"]
    expect(any(e["name"].startswith("request ") for e in events), "requests in the trace")
    return "Chrome-trace JSON (open in ui.perfetto.dev), not a binary .pftrace"


@probe("RestClient.assign_session_project")
def _(c: Ctx, call: Caller) -> str | None:
    call(c.rest, "assign_session_project", c.service.holder.get_session_id(), "project-1")
    return None


@probe("RestClient.get_audit_log")
def _(c: Ctx, call: Caller) -> str | None:
    log = call(c.rest, "get_audit_log")
    expect(any(e.event == "session_created" for e in log.entries), "session_created logged")
    return "append-only per key (a Redis stream, --audit-retention): sessions, runs, checkpoints"


@probe("RestClient.get_billing_usage")
def _(c: Ctx, call: Caller) -> str | None:
    today = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    usage = call(c.rest, "get_billing_usage", today - dt.timedelta(days=1), today)
    expect(usage.data == [], "nothing was used in 2026-01-01")
    return "hourly tokens trained / prefilled / sampled and checkpoints per session, per key"


@probe("RestClient.get_current_checkpoint_storage_usage")
def _(c: Ctx, call: Caller) -> str | None:
    expect(bool(c.sampler_path), "a checkpoint exists")
    usage = call(c.rest, "get_current_checkpoint_storage_usage")
    expect(usage.data[0].checkpoint_count > 0 and usage.data[0].size_bytes > 0, "counted")
    return "the caller's live checkpoints: count and bytes"


@probe("RestClient.whoami")
def _(c: Ctx, call: Caller) -> str | None:
    call(c.rest, "whoami")
    return None
