"""Tenancy through the real SDK against a real `lockstep serve`: age-encrypted exports, the
bare-id delete, unload_model, closed sessions, and the accounting routes scoped per key."""

from __future__ import annotations

import time
import urllib.request
import uuid
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pyrage
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from lockstep.demo import quickstart_data

from .conftest import Server

pytestmark = pytest.mark.e2e

ADAM = types.AdamParams(learning_rate=1e-2)


def _client(server: Server, key: str, **kwargs: Any) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.base_url, api_key=key, **kwargs)


def _step(trainer: Any, data: list[Any]) -> float:
    fb = trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(ADAM).result()
    return float(fb.result().metrics["loss:sum"])


def _rest(server: Server, key: str) -> tinker.RestClient:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _client(server, key).create_rest_client()


def _download(urls: dict[str, str], into: Path) -> None:
    for name, url in urls.items():
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(url, target)


def test_age_encrypted_export_decrypts_with_the_recipients_identity(
    server: Server, base_model: str, tmp_path: Path
) -> None:
    key = f"tml-age-{uuid.uuid4().hex[:8]}"
    trainer = (
        _client(server, key).create_lora_training_client(base_model=base_model, rank=4).result()
    )
    _step(trainer, quickstart_data(trainer.get_tokenizer())[:2])
    identity = pyrage.x25519.Identity.generate()
    encrypted = trainer.save_weights_external(
        "enc", age_encryption_recipients=[str(identity.to_public())]
    ).result()
    plain = trainer.save_weights_external("plain").result()
    rest = _rest(server, key)

    enc_urls = rest.get_external_weights_urls(encrypted.path).result().urls
    plain_urls = rest.get_external_weights_urls(plain.path).result().urls
    assert sorted(enc_urls) == sorted(f"{n}.age" for n in plain_urls)  # every file, encrypted
    _download(enc_urls, tmp_path / "enc")
    _download(plain_urls, tmp_path / "plain")
    for name in plain_urls:
        sealed = (tmp_path / "enc" / f"{name}.age").read_bytes()
        assert sealed.startswith(b"age-encryption.org/v1")
        with pytest.raises(pyrage.DecryptError):  # nobody else can read it
            pyrage.decrypt(sealed, [pyrage.x25519.Identity.generate()])
        (tmp_path / "dec" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dec" / name).write_bytes(pyrage.decrypt(sealed, [identity]))
        assert (tmp_path / "dec" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    tensors = load_file(tmp_path / "dec" / "adapter_model.safetensors")
    assert tensors and all(t.size for t in tensors.values())

    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        trainer.save_weights_external("bad", age_encryption_recipients=["age1nonsense"]).result()


def test_deleting_a_checkpoint_by_a_bare_id_names_the_field(
    server: Server, base_model: str
) -> None:
    key = f"tml-del-{uuid.uuid4().hex[:8]}"
    trainer = (
        _client(server, key).create_lora_training_client(base_model=base_model, rank=4).result()
    )
    saved = trainer.save_state("ckpt").result()
    rest = _rest(server, key)
    with pytest.raises(tinker.BadRequestError, match="checkpoint_id.*weights/ckpt"):
        rest.delete_checkpoint(trainer.model_id, "ckpt").result()
    rest.delete_checkpoint_from_tinker_path(saved.path).result()  # the typed form still works
    assert not rest.list_checkpoints(trainer.model_id).result().checkpoints


def _retrieve(http: httpx.Client, request_id: str) -> dict[str, Any]:
    for _ in range(100):
        body = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return dict(body)
    raise AssertionError("future never finished")


def test_unload_model_frees_the_run_and_its_next_request_restores_it(
    server: Server, base_model: str
) -> None:
    """Two identical runs; one is unloaded between steps. Its losses stay identical."""
    key = f"tml-unload-{uuid.uuid4().hex[:8]}"
    client = _client(server, key)
    kept = client.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    unloaded = client.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    data = quickstart_data(kept.get_tokenizer())[:2]
    # forward_backward is recorded (replay log) but not yet applied: unload mid-step
    fb_kept, fb_unloaded = (t.forward_backward(data, "cross_entropy") for t in (kept, unloaded))
    fb_kept.result(), fb_unloaded.result()
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": key}, timeout=60) as http:
        reply = http.post("/api/v1/unload_model", json={"model_id": unloaded.model_id})
        assert reply.status_code == 200, reply.text
        done = _retrieve(http, reply.json()["request_id"])
        assert done == {"type": "unload_model", "model_id": unloaded.model_id}
        other = http.post(
            "/api/v1/unload_model",
            json={"model_id": unloaded.model_id},
            headers={"X-API-Key": "tml-someone-else"},
        )
        assert other.status_code == 404  # another key cannot touch it
    deadline = time.monotonic() + 60  # freed at the next cycle boundary (the clock is woken)
    while f"model {unloaded.model_id} freed" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    for t in (kept, unloaded):
        t.optim_step(ADAM).result()
    losses = [_step(t, data) for t in (kept, unloaded)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-6)
    log = server.log()
    assert f"model {unloaded.model_id} freed" in log
    assert log.index(f"model {unloaded.model_id} freed") < log.index(
        f"restored {unloaded.model_id}"
    )


def test_a_closed_session_refuses_new_work_with_a_400(server: Server, base_model: str) -> None:
    key = f"tml-close-{uuid.uuid4().hex[:8]}"
    client = _client(server, key)
    trainer = client.create_lora_training_client(base_model=base_model, rank=4).result()
    data = quickstart_data(trainer.get_tokenizer())[:1]
    _step(trainer, data)
    saved = trainer.save_state("final").result()
    sampler = client.create_sampling_client(base_model=base_model).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1)).result()  # seen live
    sampler_id = sampler._sampling_session_id
    client.close("success").result()
    later = _client(server, key)
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": key}, timeout=60) as http:
        r = http.post(
            "/api/v1/optim_step",
            json={
                "model_id": trainer.model_id,
                "seq_id": 99,
                "adam_params": {"learning_rate": 0.1},
            },
        )
        assert r.status_code == 400 and "has ended" in r.json()["detail"], r.text
        assert r.json()["detail"].startswith("model_id")
        r = http.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": sampler_id,
                "seq_id": 99,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 1},
            },
        )
        assert r.status_code == 400 and "has ended" in r.json()["detail"], r.text
        assert r.json()["detail"].startswith("sampling_session_id")
    # its checkpoint outlives it: a new session loads it
    resumed = later.create_training_client_from_state(saved.path).result()
    assert _step(resumed, data) > 0


def test_accounting_is_scoped_to_the_callers_key(server: Server, base_model: str) -> None:
    mine, theirs = (f"tml-acct-{who}-{uuid.uuid4().hex[:8]}" for who in ("a", "b"))
    tag = uuid.uuid4().hex[:8]
    client = _client(server, mine, user_metadata={"tag": tag})
    other_client = _client(server, theirs, user_metadata={"tag": tag})
    trainer = client.create_lora_training_client(base_model=base_model, rank=4).result()
    second = client.create_lora_training_client(base_model=base_model, rank=4).result()
    other_trainer = other_client.create_lora_training_client(base_model=base_model, rank=4).result()
    data = quickstart_data(trainer.get_tokenizer())[:2]
    before = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    _step(trainer, data)
    saved = trainer.save_state("acct").result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(trainer.get_tokenizer().encode("hello"))
    sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4)).result()
    other_saved = other_trainer.save_state("theirs").result()
    rest, other_rest = _rest(server, mine), _rest(server, theirs)
    after = before + timedelta(hours=1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = rest.get_current_checkpoint_storage_usage().result().data
        other_storage = other_rest.get_current_checkpoint_storage_usage().result().data
        usage = rest.get_billing_usage(before, after).result()
        other_usage = other_rest.get_billing_usage(before, after).result()
        audit = rest.get_audit_log().result().entries
        other_audit = other_rest.get_audit_log().result().entries

    assert storage[0].checkpoint_count == 1 and storage[0].size_bytes > 0
    assert other_storage[0].checkpoint_count == 1
    by_type: dict[str, int] = {}
    for e in usage.data:
        n = getattr(e.event_info, "token_count", None) or getattr(e.event_info, "count", 0)
        by_type[e.event_info.type] = by_type.get(e.event_info.type, 0) + n
    n_tokens = sum(len(d.model_input.to_ints()) for d in data)
    assert by_type["training"] == n_tokens
    assert by_type["sampling_prefill"] == len(prompt.to_ints())  # one request, two samples
    assert 0 < by_type["sampling_sample"] <= 2 * 4
    assert by_type["checkpoint"] >= 1
    assert {e.session_id for e in usage.data} == {trainer.model_id.split(":")[0]}
    other_types = {e.event_info.type: e.event_info for e in other_usage.data}
    assert other_types["checkpoint"].count == 1  # theirs: one save, no tokens, a cycle share
    assert other_types["training"].token_count == 0
    assert "sampling_sample" not in other_types

    # the counts the SDK's types have no field for (it ignores them): steps, samples, seconds
    raw = httpx.get(
        server.base_url + "/api/v1/billing/usage/events",
        params={"starting_on": before.isoformat(), "ending_before": after.isoformat()},
        headers={"X-API-Key": mine},
    ).json()["data"]
    infos = [e["event_info"] for e in raw]
    assert sum(i.get("steps") or 0 for i in infos) == 1
    assert sum(i.get("samples") or 0 for i in infos) == 2
    assert sum(i.get("cycle_seconds") or 0 for i in infos) > 0

    events = [(e.event, e.tinker_path) for e in audit]
    assert ("checkpoint_created", saved.path) in events
    assert ("training_run_created", trainer.model_id) in [(e.event, e.model_id) for e in audit]
    assert any(e.event == "session_created" for e in audit)
    assert saved.path not in {e.tinker_path for e in other_audit}
    assert ("checkpoint_created", other_saved.path) in [
        (e.event, e.tinker_path) for e in other_audit
    ]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = rest.search_sessions(
            types.SessionSearchRequest(user_metadata={"tag": tag})
        ).result()
        other_found = other_rest.search_sessions(
            types.SessionSearchRequest(user_metadata={"tag": tag})
        ).result()
    assert [s.session_id for s in found.sessions] == [trainer.model_id.split(":")[0]]
    assert found.sessions[0].checkpoints_count == 1
    assert [s.session_id for s in other_found.sessions] == [other_trainer.model_id.split(":")[0]]

    session_id, seq = second.model_id.split(":train:")
    with pytest.raises(tinker.BadRequestError, match="session_id"):  # projects: not served
        rest.copy_weights(saved.path, "some-project").result()
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"source_path": saved.path, "session_id": session_id, "model_seq_id": int(seq)}
        r = http.post("/api/v1/copy_weights", json=body, headers={"X-API-Key": mine})
        assert r.status_code == 200, r.text
        stolen = http.post("/api/v1/copy_weights", json=body, headers={"X-API-Key": theirs})
        assert stolen.status_code == 404  # neither the source nor the run are theirs
    path = r.json()["tinker_path"]
    assert path == f"tinker://{second.model_id}/weights/acct"
    assert [c.tinker_path for c in rest.list_checkpoints(second.model_id).result().checkpoints] == [
        path
    ]
    restored = client.create_training_client_from_state(path).result()
    assert _step(restored, data) > 0
