"""Run tinker_cookbook.preference.train_dpo.main on a local comparisons JSONL (cookbook venv).

The DPO CLI only offers hub datasets, so this calls `train_dpo.main` directly with
`ComparisonBuilderFromJsonl`. The model is served under a hub name the cookbook knows (an alias
given to `lockstep serve --model NAME=DIR`); the cookbook would fetch that name's tokenizer from
the hub, so the local tokenizer is registered under the name first.

Usage: python dpo_pairs.py '<json config>' (keys: see `main`).
"""

from __future__ import annotations

import json
import sys

from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import register_tokenizer
from transformers import AutoTokenizer


def main(cfg: dict) -> None:
    model_name = cfg["model_name"]
    if cfg.get("tokenizer_dir"):
        tokenizer_dir = cfg["tokenizer_dir"]
        register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(tokenizer_dir))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model_name,
        renderer_name="role_colon",
        max_length=256,
        batch_size=cfg.get("batch_size", 8),
    )
    config = train_dpo.Config(
        log_path=cfg["log_path"],
        model_name=model_name,
        recipe_name="lockstep_dpo_pairs",
        renderer_name="role_colon",
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=common,
            comparison_builder=ComparisonBuilderFromJsonl(train_path=cfg["pairs_path"]),
        ),
        learning_rate=cfg["learning_rate"],
        lr_schedule="constant",
        dpo_beta=cfg.get("dpo_beta", 0.1),
        num_epochs=cfg.get("num_epochs", 10),
        lora_rank=cfg.get("lora_rank", 32),
        base_url=cfg["base_url"],
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
    )
    train_dpo.main(config)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
