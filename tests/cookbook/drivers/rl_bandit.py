"""Run tinker_cookbook.rl.train.main on a one-token "parity bandit" (run with the cookbook venv).

Each episode is one prompt ("pick i", rendered by the role_colon renderer) and one sampled token;
the reward is 1 when the token id is even. On a random model about half the vocabulary is even,
so the reward starts near 0.5 and the policy can push it to 1 (the low-baseline case collapses
too easily to make a good test; see shared/spec/cookbook-offline.md §5.0).

Usage: python rl_bandit.py '<json config>' (keys: see `main`). Writes the cookbook's usual
metrics.jsonl / checkpoints.jsonl under log_path.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence

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


class ParityEnv(Env):
    def __init__(self, prompt: str, renderer: renderers.Renderer) -> None:
        self.prompt = prompt
        self.renderer = renderer

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        message: renderers.Message = {"role": "user", "content": self.prompt}
        return self.renderer.build_generation_prompt([message]), self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: object = None) -> StepResult:
        return StepResult(
            reward=float(len(action) > 0 and action[0] % 2 == 0),
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
            metrics={},
        )


class ParityGroupBuilder(EnvGroupBuilder):
    def __init__(self, prompt: str, renderer: renderers.Renderer, group_size: int) -> None:
        self.prompt = prompt
        self.renderer = renderer
        self.group_size = group_size

    async def make_envs(self) -> Sequence[Env]:
        return [ParityEnv(self.prompt, self.renderer) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["parity"]


class ParityDataset(RLDataset):
    def __init__(
        self, renderer: renderers.Renderer, n_batches: int, groups_per_batch: int, group_size: int
    ) -> None:
        self.renderer = renderer
        self.n_batches = n_batches
        self.groups_per_batch = groups_per_batch
        self.group_size = group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return [
            ParityGroupBuilder(f"pick {index * self.groups_per_batch + g}", self.renderer,
                               self.group_size)
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

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))
        return ParityDataset(renderer, self.n_batches, self.groups_per_batch, self.group_size), None


def main(cfg: dict) -> None:
    model = cfg["model_name"]
    kl_ref = cfg.get("kl_reference_base_model")
    config = train.Config(
        learning_rate=cfg["learning_rate"],
        dataset_builder=ParityDatasetBuilder(
            model_name=model,
            renderer_name="role_colon",
            n_batches=cfg.get("steps", 20),
            groups_per_batch=cfg.get("groups_per_batch", 8),
            group_size=cfg.get("group_size", 8),
        ),
        model_name=model,
        recipe_name="lockstep_parity_bandit",
        renderer_name="role_colon",
        max_tokens=1,
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
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
