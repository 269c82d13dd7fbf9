"""tinker-cookbook recipes, unmodified and offline, against a real `lockstep serve`.

Learning rates are calibrated for the built-in tiny random Qwen3 (1024-token vocab, LoRA rank 32,
alpha 32): cross_entropy trains well at 3e-3 to 5e-3 (5e-3 already spikes now and then at rank
32; 1e-2 can blow up), while the one-token RL bandit and DPO want 1e-2. See
tests/cookbook/README.md for the measured numbers.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import tinker

from tests.integration.conftest import API_KEY

from .conftest import ALIAS_MODEL, Cookbook, read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.cookbook]

SL_LR = 3e-3
SL_STEPS = 12
SL_SAVE_EVERY = 4


def _rest(cookbook: Cookbook) -> tinker.RestClient:
    return tinker.RestClient(base_url=cookbook.server.base_url, api_key=API_KEY)


def _metric_rows(log_path: Path) -> dict[int, dict[str, Any]]:
    return {row["step"]: row for row in read_jsonl(log_path / "metrics.jsonl")}


# --------------------------------------------------------------------------------- chat_sl


@pytest.fixture(scope="module")
def chat_sl_run(
    cookbook: Cookbook, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    """chat_sl on the wheel's example_data/conversations.jsonl, renderer role_colon."""
    log_path = tmp_path_factory.mktemp("chat_sl") / "run"
    config = dict(
        dataset=cookbook.package_dir / "example_data" / "conversations.jsonl",
        model_name=cookbook.model_dir,
        renderer_name="role_colon",
        base_url=cookbook.server.base_url,
        batch_size=16,
        max_length=512,
        learning_rate=SL_LR,
        lr_schedule="constant",
        num_epochs=4,
        save_every=SL_SAVE_EVERY,
        eval_every=0,
        max_steps=SL_STEPS,
        log_path=log_path,
        behavior_if_log_dir_exists="delete",
    )
    cookbook.recipe("tinker_cookbook.recipes.chat_sl.train", log_path.with_suffix(".log"), **config)
    return log_path, config


def test_chat_sl_train_nll_falls(chat_sl_run: tuple[Path, dict[str, Any]]) -> None:
    log_path, _ = chat_sl_run
    rows = _metric_rows(log_path)
    assert sorted(rows) == list(range(SL_STEPS))
    nll = [rows[s]["train_mean_nll"] for s in range(SL_STEPS)]
    print(f"chat_sl train_mean_nll: {[round(x, 3) for x in nll]}")
    assert abs(nll[0] - math.log(1024)) < 0.35  # a random model: about ln(vocab)
    assert nll[-1] < 0.8 * nll[0], nll
    assert all("grad_norm:mean" in rows[s] for s in rows)  # optim_step metrics are merged
    checkpoints = read_jsonl(log_path / "checkpoints.jsonl")
    names = [c["name"] for c in checkpoints]
    assert names == ["000004", "000008", "final"], checkpoints
    assert all(
        c["state_path"].startswith("tinker://") and c["sampler_path"].startswith("tinker://")
        for c in checkpoints
    )


def test_chat_sl_resumes_from_its_checkpoint(
    cookbook: Cookbook, chat_sl_run: tuple[Path, dict[str, Any]]
) -> None:
    """behavior_if_log_dir_exists=resume loads the last checkpoint row with its optimizer state
    (create_training_client_from_state_with_optimizer) after checking the run's renderer through
    get_training_run_by_tinker_path."""
    log_path, config = chat_sl_run
    checkpoints = read_jsonl(log_path / "checkpoints.jsonl")
    first_final = checkpoints[-1]
    resume_from = checkpoints[-2]  # 000008; drop the final row so the run is unfinished
    (log_path / "checkpoints.jsonl").write_text(
        "".join(json.dumps(c) + "\n" for c in checkpoints[:-1])
    )

    text = cookbook.recipe(
        "tinker_cookbook.recipes.chat_sl.train",
        log_path.with_name("resume.log"),
        **{**config, "behavior_if_log_dir_exists": "resume"},
    )
    assert f"Resumed training from {resume_from['state_path']}" in text, text[-3000:]
    assert "Could not fetch renderer metadata" not in text
    rows = read_jsonl(log_path / "metrics.jsonl")
    # cookbook 0.5.8 appends: the first run's 12 rows, then the resumed run's steps 8..11 (it
    # starts at the 000008 row's loop state: epoch 1, batch 0).
    steps = [r["step"] for r in rows]
    assert steps == list(range(SL_STEPS)) + list(range(8, SL_STEPS)), steps
    nll = [r["train_mean_nll"] for r in rows]
    print(f"chat_sl resumed train_mean_nll: {[round(x, 3) for x in nll[SL_STEPS:]]}")
    assert nll[-1] < 0.8 * nll[0], nll

    final = read_jsonl(log_path / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["state_path"] != first_final["state_path"]
    rest = _rest(cookbook)
    resumed_run = rest.get_training_run_by_tinker_path(final["state_path"]).result()
    first_run = rest.get_training_run_by_tinker_path(resume_from["state_path"]).result()
    assert resumed_run.training_run_id != first_run.training_run_id
    assert (resumed_run.user_metadata or {}).get("renderer_name") == "role_colon"
    assert (first_run.user_metadata or {}).get("renderer_name") == "role_colon"


# --------------------------------------------------------------------------------- math_rl


def test_math_rl_arithmetic_two_steps(cookbook: Cookbook, tmp_path: Path) -> None:
    log_path = tmp_path / "math_rl"
    cookbook.recipe(
        "tinker_cookbook.recipes.math_rl.train",
        tmp_path / "math_rl.log",
        env="arithmetic",
        model_name=cookbook.model_dir,
        renderer_name="role_colon",
        base_url=cookbook.server.base_url,
        loss_fn="importance_sampling",
        group_size=4,
        groups_per_batch=8,
        max_tokens=16,
        learning_rate=1e-3,
        max_steps=2,
        eval_every=0,
        save_every=0,
        log_path=log_path,
        behavior_if_log_dir_exists="delete",
    )
    rows = _metric_rows(log_path)
    assert sorted(rows) == [0, 1]
    for step, row in rows.items():
        for key in (
            "env/all/reward/total",
            "env/all/correct",
            "env/all/format",
            "optim/kl_sample_train_v1",
            "optim/kl_sample_train_v2",
        ):
            assert key in row, (step, sorted(row))
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3, row
    final = read_jsonl(log_path / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["sampler_path"].startswith("tinker://"), final


# ------------------------------------------------------------------------- rl.train.main


# KL penalty against the base model (service_client.create_sampling_client(base_model=)) and
# rolling checkpoints (save_state with a TTL, then delete_checkpoint_from_tinker_path) ride along
# with importance_sampling.
BANDIT_RUNS: dict[str, dict[str, Any]] = {
    "importance_sampling": {"kl_penalty_coef": 0.01, "rolling_save_every": 3},
    "ppo": {"loss_fn_config": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}},
    "cispo": {},
}


@pytest.fixture(scope="module")
def bandit_runs(
    cookbook: Cookbook, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, str]]:
    """The three rl.train.main runs, side by side (three tenants of one server)."""
    root = tmp_path_factory.mktemp("rl")
    running = {}
    for loss_fn, extra in BANDIT_RUNS.items():
        if "kl_penalty_coef" in extra:
            extra = {**extra, "kl_reference_base_model": str(cookbook.model_dir)}
        running[loss_fn] = cookbook.driver(
            "rl_bandit.py",
            root / f"{loss_fn}.log",
            model_name=str(cookbook.model_dir),
            base_url=cookbook.server.base_url,
            log_path=str(root / loss_fn),
            loss_fn=loss_fn,
            learning_rate=1e-2,
            steps=20,
            save_every=10,
            **extra,
        )
    try:
        return {loss_fn: (root / loss_fn, r.wait()) for loss_fn, r in running.items()}
    finally:
        for r in running.values():  # a failed run must not leave the others behind
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


@pytest.mark.parametrize("loss_fn", list(BANDIT_RUNS))
def test_rl_train_raises_bandit_reward(
    cookbook: Cookbook, loss_fn: str, bandit_runs: dict[str, tuple[Path, str]]
) -> None:
    log_path, text = bandit_runs[loss_fn]
    extra = BANDIT_RUNS[loss_fn]
    rows = _metric_rows(log_path)
    assert sorted(rows) == list(range(20))
    rewards = [rows[s]["env/all/reward/total"] for s in range(20)]
    kls = [rows[s]["optim/kl_sample_train_v1"] for s in range(20)]
    print(
        f"{loss_fn} reward: {[round(r, 3) for r in rewards]}; max |kl_v1| "
        f"{max(abs(k) for k in kls):.2e}"
    )
    assert 0.3 <= sum(rewards[:3]) / 3 <= 0.7, rewards  # the baseline is about 0.5
    # Learned: most of the second half at the optimum. Runs are not bit-identical (a tenant's
    # numbers equal packed ones to 1e-5, not bitwise, and a sampled token can flip), and a single
    # step's batch can dip (down to 0.36 once in 10 runs with importance_sampling; a mean of the
    # last three steps failed CI that way), so no single step decides.
    assert max(rewards) >= 0.95 and statistics.median(rewards[10:]) >= 0.9, rewards
    assert all(abs(k) < 1e-3 for k in kls), kls  # sampler and trainer hold the same weights
    assert all(rows[s]["optim/entropy"] > 0 for s in rows)

    checkpoints = read_jsonl(log_path / "checkpoints.jsonl")
    periodic = [c for c in checkpoints if not c.get("rolling")]
    assert [c["name"] for c in periodic] == ["000010", "000020", "final"], checkpoints
    rest = _rest(cookbook)
    run_id = rest.get_training_run_by_tinker_path(periodic[-1]["state_path"]).result()
    listed = {
        c.tinker_path: c for c in rest.list_checkpoints(run_id.training_run_id).result().checkpoints
    }
    assert periodic[0]["state_path"] in listed and periodic[-1]["state_path"] in listed
    assert listed[periodic[0]["state_path"]].expires_at is not None  # ttl_seconds: 7 days
    assert listed[periodic[-1]["state_path"]].expires_at is None  # the final one is kept
    if extra.get("kl_penalty_coef"):
        # The KL penalty scored every batch with the base model's sampler (compute_logprobs).
        assert all("kl_policy_base" in row for row in rows.values()), sorted(rows[0])
        assert abs(rows[0]["kl_policy_base"]) < 1e-3  # step 0: the policy is the base model
        rolling = [c for c in checkpoints if c.get("rolling")]
        assert len(rolling) >= 5, checkpoints
        assert "Failed to delete rolling checkpoint" not in text
        assert not any(c["state_path"] in listed for c in rolling), "rolling saves not deleted"


# ------------------------------------------------------------------------------------ DPO

FRUITS = ["apple", "banana", "cherry", "grape", "mango", "peach", "pear", "plum"]
OTHERS = ["carrot", "brick", "chair", "potato", "hammer", "cloud", "spoon", "onion"]


def test_dpo_on_local_comparisons(cookbook: Cookbook, tmp_path: Path) -> None:
    """train_dpo.main via forward_backward_custom; the model is named by a hub alias."""
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for fruit, other in zip(FRUITS, OTHERS, strict=True):
            for word, label in ((fruit, "A"), (other, "B")):
                f.write(
                    json.dumps(
                        {
                            "comparison": {
                                "prompt_conversation": [
                                    {"role": "user", "content": f"Is {word} a fruit?"}
                                ],
                                "completion_A": [{"role": "assistant", "content": "Yes."}],
                                "completion_B": [{"role": "assistant", "content": "No."}],
                            },
                            "label": label,
                        }
                    )
                    + "\n"
                )
    log_path = tmp_path / "dpo"
    cookbook.driver(
        "dpo_pairs.py",
        tmp_path / "dpo.log",
        model_name=ALIAS_MODEL,
        tokenizer_dir=str(cookbook.model_dir),
        base_url=cookbook.server.base_url,
        log_path=str(log_path),
        pairs_path=str(pairs),
        learning_rate=1e-2,
        num_epochs=10,
    ).wait()
    rows = _metric_rows(log_path)
    assert sorted(rows) == list(range(20))
    loss = [rows[s]["dpo_loss"] for s in range(20)]
    accuracy = [rows[s]["accuracy"] for s in range(20)]
    print(f"dpo_loss: {[round(x, 4) for x in loss]}; accuracy: {accuracy}")
    # Step 0: the policy is the reference, so every log-ratio is 0 and the loss is exactly ln 2
    # (it drifts if the sampler's reference logprobs disagree with the trainer's).
    assert abs(loss[0] - math.log(2)) < 0.005, loss[0]
    assert max(accuracy[:16]) == 1.0 and accuracy[-1] == 1.0, accuracy
    assert loss[-1] < 0.2 and rows[19]["margin"] > rows[0]["margin"], rows[19]
    assert all(
        "loss:sum" in r and "surrogate_loss:sum" in r and "clock_cycle:unique" in r
        for r in rows.values()
    )
