"""`lockstep demo`: start the service and run the Tinker docs' Pig Latin quickstart against it.

It uses the unmodified `tinker` SDK over HTTP, exactly as a researcher would.
"""

from __future__ import annotations

import logging
import os

from lockstep.supervisor import ServeConfig, Supervisor

log = logging.getLogger("lockstep.demo")

PIG_LATIN = [
    ("banana split", "anana-bay plit-say"),
    ("quantum physics", "uantum-qay ysics-phay"),
    ("donut shop", "onut-day op-shay"),
    ("pickle jar", "ickle-pay ar-jay"),
    ("space exploration", "ace-spay exploration-way"),
    ("rubber duck", "ubber-ray uck-day"),
    ("coding wizard", "oding-cay izard-way"),
]


def quickstart_data(tokenizer) -> list:  # type: ignore[no-untyped-def]
    """The docs' datums: prompt tokens weighted 0, completion tokens weighted 1."""
    import numpy as np
    from tinker import types

    data = []
    for english, pig in PIG_LATIN:
        prompt = tokenizer.encode(f"English: {english}\nPig Latin:", add_special_tokens=True)
        completion = tokenizer.encode(f" {pig}\n\n", add_special_tokens=False)
        tokens = prompt + completion
        weights = [0.0] * len(prompt) + [1.0] * len(completion)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:], np.int64)),
                "weights": types.TensorData.from_numpy(np.array(weights[1:], np.float32)),
            },
        ))
    return data


def run_quickstart(base_url: str, model: str, steps: int, learning_rate: float = 5e-3) -> None:
    import numpy as np
    import tinker
    from rich.console import Console
    from rich.progress import Progress
    from tinker import types

    console = Console()
    service = tinker.ServiceClient(base_url=base_url, api_key=os.environ.get(
        "TINKER_API_KEY", "tml-demo"))
    trainer = service.create_lora_training_client(
        base_model=model, rank=32, seed=0).result()
    tokenizer = trainer.get_tokenizer()
    data = quickstart_data(tokenizer)
    total_weight = sum(float(np.sum(d.loss_fn_inputs["weights"].to_numpy())) for d in data)
    with Progress(console=console) as progress:
        task = progress.add_task("training", total=steps)
        for step in range(steps):
            fb = trainer.forward_backward(data, "cross_entropy")
            opt = trainer.optim_step(types.AdamParams(learning_rate=learning_rate))
            result = fb.result()
            opt.result()
            loss = result.metrics["loss:sum"] / total_weight
            cycle = int(result.metrics["clock_cycle:unique"])
            progress.console.print(f"step {step:3d}  loss/token {loss:7.4f}  cycle {cycle}")
            progress.advance(task)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("English: banana split\nPig Latin:"))
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
    out = sampler.sample(prompt=prompt, sampling_params=params, num_samples=1).result()
    text = tokenizer.decode(out.sequences[0].tokens)
    console.print(f"[bold]English: banana split -> Pig Latin:[/bold]{text!r}")


def run_demo(cfg: ServeConfig, steps: int) -> int:
    sup = Supervisor(cfg)
    try:
        sup.start()
        sup.wait_ready()
        run_quickstart(f"http://{cfg.host}:{cfg.port}", cfg.served_names[0], steps)
        return 0
    except Exception:
        log.exception("demo failed")
        return 1
    finally:
        sup.stop()
