"""The demo's tenants: each owns a LoRA training run and takes one training step at a time.

Every tenant talks to the server through its own `tinker.ServiceClient` (its own API key), as
separate users would. A step is the SDK calls a researcher makes for one optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from lockstep.demo.data import (
    CAPITALS,
    CAPITALS_TEMPLATE,
    COLOURS,
    PIG_LATIN,
    PIG_LATIN_TEMPLATE,
    colour_data,
    colour_image,
    colour_prompt,
    sft_data,
)


def _tensor(values: list[Any], dtype: type = np.float32) -> Any:
    from tinker import types

    return types.TensorData.from_numpy(np.array(values, dtype))


class Task(StrEnum):
    PIG_LATIN = "SFT: Pig Latin"
    CAPITALS = "SFT: capitals"
    EVEN_TOKENS = "RL: even token ids"
    COLOURS = "SFT: an image's colour"

    @property
    def rl(self) -> bool:
        return self is Task.EVEN_TOKENS


@dataclass
class StepRecord:
    seconds: float
    value: float  # loss per token (SFT) or mean reward (RL)
    cycle: int  # the clock cycle the forward_backward ran in


@dataclass
class Tenant:
    """One training run. `task` decides what a step does; `value_name` is what it reports."""

    name: str
    task: Task
    rank: int
    learning_rate: float
    seed: int
    warmup: list[StepRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    solo: list[StepRecord] = field(default_factory=list)
    latest: StepRecord | None = None  # the last step taken, whichever way
    greedy: str = ""
    trainer: Any = None
    tokenizer: Any = None
    data: list[Any] = field(default_factory=list)
    total_weight: float = 1.0

    @property
    def value_name(self) -> str:
        return "reward" if self.task.rl else "loss/token"

    # ------------------------------------------------------------------ setup
    def connect(self, base_url: str, model: str) -> None:
        import tinker

        service = tinker.ServiceClient(base_url=base_url, api_key=f"tml-demo-{self.name}")
        self.trainer = service.create_lora_training_client(
            base_model=model, rank=self.rank, seed=self.seed
        ).result()
        self.tokenizer = self.trainer.get_tokenizer()
        if self.task is Task.COLOURS:
            self.data = colour_data(self.tokenizer)
            self.total_weight = sum(
                float(np.sum(d.loss_fn_inputs["weights"].to_numpy())) for d in self.data
            )
        elif not self.task.rl:
            pairs, template = self._pairs()
            self.data = sft_data(self.tokenizer, pairs, template)
            self.total_weight = sum(
                float(np.sum(d.loss_fn_inputs["weights"].to_numpy())) for d in self.data
            )

    def _pairs(self) -> tuple[list[tuple[str, str]], str]:
        if self.task is Task.PIG_LATIN:
            return PIG_LATIN, PIG_LATIN_TEMPLATE
        return CAPITALS, CAPITALS_TEMPLATE

    # ------------------------------------------------------------------ one step
    def step(self) -> StepRecord:
        start = time.monotonic()
        if self.task.rl:
            data, value = self._rollouts()
            loss = "importance_sampling"
        else:
            data, value = self.data, float("nan")
            loss = "cross_entropy"
        from tinker import types

        fb = self.trainer.forward_backward(data, loss)
        adam = types.AdamParams(learning_rate=self.learning_rate)
        if self.task is Task.COLOURS:  # steadier on the tiny random VLM (no loss spikes)
            adam = types.AdamParams(learning_rate=self.learning_rate, beta2=0.999, eps=1e-8)
        opt = self.trainer.optim_step(adam)
        result = fb.result()
        opt.result()
        if not self.task.rl:
            value = result.metrics["loss:sum"] / self.total_weight
        cycle = int(result.metrics["clock_cycle:unique"])
        self.latest = StepRecord(time.monotonic() - start, value, cycle)
        return self.latest

    def _prompts(self) -> list[list[int]]:
        return [self.tokenizer.encode(f"pick {i}:") for i in range(4)]

    def _rollouts(self) -> tuple[list[Any], float]:
        """Sample from the current weights; reward 1 for an even token id (importance sampling
        with the sampler's logprobs, advantages centred per prompt)."""
        from tinker import types

        sampler = self.trainer.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=1, temperature=1.0)
        prompts = self._prompts()
        futures = [
            sampler.sample(
                prompt=types.ModelInput.from_ints(p), num_samples=8, sampling_params=params
            )
            for p in prompts
        ]
        data: list[Any] = []
        rewards_all: list[float] = []
        for prompt, fut in zip(prompts, futures, strict=True):
            seqs = fut.result().sequences
            rewards = np.array([float(s.tokens[0] % 2 == 0) for s in seqs])
            rewards_all.extend(rewards)
            n = len(prompt)
            for seq, adv in zip(seqs, rewards - rewards.mean(), strict=True):
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(prompt),
                        loss_fn_inputs={
                            "target_tokens": _tensor(prompt[1:] + [seq.tokens[0]], np.int64),
                            "logprobs": _tensor([0.0] * (n - 1) + [seq.logprobs[0]]),
                            "advantages": _tensor([0.0] * (n - 1) + [float(adv)]),
                        },
                    )
                )
        return data, float(np.mean(rewards_all))

    # ------------------------------------------------------------------ the result
    def sample_greedy(self) -> None:
        from tinker import types

        sampler = self.trainer.save_weights_and_get_sampling_client().result()
        if self.task.rl:
            params = types.SamplingParams(max_tokens=1, temperature=0.0)
            first = types.ModelInput.from_ints(self._prompts()[0])
            out = sampler.sample(first, 1, params).result()
            token = out.sequences[0].tokens[0]
            parity = "even" if token % 2 == 0 else "odd"
            self.greedy = f"'pick 0:' -> token {token} ({parity}, reward {int(token % 2 == 0)})"
            return
        if self.task is Task.COLOURS:  # images it was not trained on
            params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=["<|im_end|>"])
            answers = []
            for name, rgb in COLOURS.items():
                prompt = colour_prompt(self.tokenizer, colour_image(rgb, seed=99))
                out = sampler.sample(prompt, 1, params).result()
                text = self.tokenizer.decode(out.sequences[0].tokens, skip_special_tokens=True)
                answers.append(f"[new {name} image] -> {text.strip()!r}")
            self.greedy = "'What colour is this?' " + ", ".join(answers)
            return
        pairs, template = self._pairs()
        text = template.format(pairs[0][0])
        params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
        prompt = types.ModelInput.from_ints(self.tokenizer.encode(text))
        out = sampler.sample(prompt, 1, params).result()
        completion = self.tokenizer.decode(out.sequences[0].tokens)
        self.greedy = f"{text!r} -> {completion!r}"


def make_tenants(n: int, vision: bool = False) -> list[Tenant]:
    """Pig Latin SFT (rank 32), the RL bandit (rank 16), capitals SFT (rank 8), then again;
    with `vision` (a vision-language model served) the first tenant learns an image's colour."""
    kinds = [
        ("piglatin", Task.PIG_LATIN, 32, 5e-3),
        ("rl", Task.EVEN_TOKENS, 16, 1e-2),
        ("capitals", Task.CAPITALS, 8, 1e-2),
    ]
    tenants = []
    for i in range(n):
        name, task, rank, lr = kinds[i % len(kinds)]
        round_ = i // len(kinds)
        suffix = f"-{round_ + 1}" if n > len(kinds) else ""
        tenants.append(Tenant(f"{name}{suffix}", task, rank, lr, seed=round_))
    if vision:
        tenants[0] = Tenant("colours", Task.COLOURS, 16, 5e-3, seed=0)
    return tenants
