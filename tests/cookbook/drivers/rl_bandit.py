"""Run tinker_cookbook.rl.train.main on a one-token "parity bandit" (run with the cookbook venv).

Each episode is one prompt ("pick i", rendered by the role_colon renderer) and one sampled token;
the reward is 1 when the token id is even. On a random model about half the vocabulary is even,
so the reward starts near 0.5 and the policy can push it to 1 (the low-baseline case collapses
too easily to make a good test; see shared/spec/cookbook-offline.md §5.0).

Every sample is seeded (see `seed_every_sample`), so a run gives the same rewards every time: the
server's sampler draws a row from its own seeded generator whatever batch it lands in, and the
adapter starts from the LoRA seed's init. An unseeded run is a coin toss that now and then dips
below the test's threshold late in the run (seen once in CI: 1.0, then 0.156 at step 18).

Usage: python rl_bandit.py '<json config>' (keys: see `main`; `async_config` runs the cookbook's
async loop). Writes the cookbook's usual
metrics.jsonl / checkpoints.jsonl under log_path.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import (
    Action,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
    StopCondition,
)
from tinker_cookbook.tokenizer_utils import get_tokenizer


def seed_every_sample(base_seed: int) -> None:
    """Give each sample request a seed when the recipe sets none (the cookbook's completer never
    does): a hash of the base seed, the prompt's tokens and how many times this prompt was sampled
    before. The calls of one group share a prompt and start concurrently, so which env gets which
    seed may vary, but the group's set of samples, and so every reward, does not."""
    calls: Counter[tuple[int, ...]] = Counter()
    original = tinker.SamplingClient.sample

    def sample(self, prompt, num_samples, sampling_params, *args, **kwargs):  # type: ignore[no-untyped-def]
        if sampling_params.seed is None:
            tokens = tuple(prompt.to_ints())
            digest = hashlib.sha256(json.dumps([base_seed, tokens, calls[tokens]]).encode())
            calls[tokens] += 1
            seed = int.from_bytes(digest.digest()[:8], "little") >> 1
            sampling_params = sampling_params.model_copy(update={"seed": seed})
        return original(self, prompt, num_samples, sampling_params, *args, **kwargs)

    tinker.SamplingClient.sample = sample  # type: ignore[method-assign]


async def _trained_through(metrics: Path | None, step: int) -> None:
    """Wait until the training loop has logged `step` (metrics.jsonl holds one row per step)."""
    while metrics is not None and step >= 0:
        rows = metrics.read_text().count("\n") if metrics.is_file() else 0
        if rows > step:
            return
        await asyncio.sleep(0.05)


class ParityEnv(Env):
    def __init__(
        self, prompt: str, renderer: renderers.Renderer, batch: int, pace: Path | None
    ) -> None:
        self.prompt = prompt
        self.renderer = renderer
        self.batch = batch
        self.pace = pace

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        message: renderers.Message = {"role": "user", "content": self.prompt}
        return self.renderer.build_generation_prompt([message]), self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: object = None) -> StepResult:
        # Pacing (async runs): an episode of batch b ends once step b - 1 has trained, like an
        # environment slower than one step. Its sample still runs while that step trains.
        await _trained_through(self.pace, self.batch - 1)
        return StepResult(
            reward=float(len(action) > 0 and action[0] % 2 == 0),
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
            metrics={},
        )


class ParityGroupBuilder(EnvGroupBuilder):
    def __init__(
        self,
        prompt: str,
        renderer: renderers.Renderer,
        group_size: int,
        batch: int = 0,
        pace: Path | None = None,
    ) -> None:
        self.prompt = prompt
        self.renderer = renderer
        self.group_size = group_size
        self.batch = batch
        self.pace = pace

    async def make_envs(self) -> Sequence[Env]:
        return [
            ParityEnv(self.prompt, self.renderer, self.batch, self.pace)
            for _ in range(self.group_size)
        ]

    def logging_tags(self) -> list[str]:
        return ["parity"]


class ParityDataset(RLDataset):
    def __init__(
        self,
        renderer: renderers.Renderer,
        n_batches: int,
        groups_per_batch: int,
        group_size: int,
        pace: Path | None = None,
    ) -> None:
        self.renderer = renderer
        self.n_batches = n_batches
        self.groups_per_batch = groups_per_batch
        self.group_size = group_size
        self.pace = pace

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [
            ParityGroupBuilder(
                f"pick {index * self.groups_per_batch + g}",
                self.renderer,
                self.group_size,
                index,
                self.pace,
            )
            for g in range(self.groups_per_batch)
        ]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class ParityDatasetBuilder(RLDatasetBuilder):
    model_name: str
    renderer_name: str
    n_batches: int = 20
    groups_per_batch: int = 8
    group_size: int = 8
    pace_metrics: str | None = None  # the run's metrics.jsonl: pace episodes by training steps

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))
        pace = Path(self.pace_metrics) if self.pace_metrics else None
        dataset = ParityDataset(
            renderer, self.n_batches, self.groups_per_batch, self.group_size, pace
        )
        return dataset, None


def main(cfg: dict) -> None:
    seed_every_sample(cfg.get("seed", 0))
    model = cfg["model_name"]
    kl_ref = cfg.get("kl_reference_base_model")
    # {"max_steps_off_policy": K, "groups_per_batch": G}: the cookbook's async (off-policy) loop.
    async_cfg = cfg.get("async_config")
    config = train.Config(
        learning_rate=cfg["learning_rate"],
        dataset_builder=ParityDatasetBuilder(
            model_name=model,
            renderer_name="role_colon",
            n_batches=cfg.get("steps", 20),
            groups_per_batch=cfg.get("groups_per_batch", 8),
            group_size=cfg.get("group_size", 8),
            # Async runs are paced: 1-token rollouts outrun training, and once its dataloader is
            # done the cookbook discards every too-stale group, ending the run early.
            pace_metrics=str(Path(cfg["log_path"]) / "metrics.jsonl") if async_cfg else None,
        ),
        model_name=model,
        recipe_name="lockstep_parity_bandit",
        renderer_name="role_colon",
        max_tokens=cfg.get("max_tokens", 1),  # the reward reads the first token only
        log_path=cfg["log_path"],
        base_url=cfg["base_url"],
        loss_fn=cfg["loss_fn"],
        loss_fn_config=cfg.get("loss_fn_config"),
        lora_rank=cfg.get("lora_rank", 32),
        eval_every=0,
        save_every=cfg.get("save_every", 10),
        rolling_save_every=cfg.get("rolling_save_every", 0),
        kl_penalty_coef=cfg.get("kl_penalty_coef", 0.0),
        kl_reference_config=train.KLReferenceConfig(base_model=kl_ref) if kl_ref else None,
        num_groups_to_log=0,
        async_config=train.AsyncConfig(**async_cfg) if async_cfg else None,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
