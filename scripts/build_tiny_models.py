"""Build the tiny random models of the architectures Lockstep trains (lockstep/modeling/zoo.py,
and the vision-language ones of lockstep/modeling/vision/zoo.py).

    python scripts/build_tiny_models.py DIR [FAMILY ...]     # default: every family
    lockstep serve --model Lockstep/tiny-qwen3-moe=DIR/tiny-qwen3_moe-<digest>

Offline (the built-in tokenizer, transformers configs, name-seeded weights). Idempotent and
atomic: a finished model directory is reused; prints each family's directory and served name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.modeling import zoo
from lockstep.modeling.vision import zoo as vision_zoo

BUILDERS = {
    **{family: zoo for family in zoo.FAMILIES},
    **{family: vision_zoo for family in vision_zoo.FAMILIES},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=", ".join(sorted(BUILDERS)))
    args = parser.parse_args()
    unknown = sorted(set(args.families) - set(BUILDERS))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(sorted(BUILDERS))}")
    for family in args.families or sorted(BUILDERS):
        module = BUILDERS[family]
        directory = module.ensure_family(family, args.out_dir)
        print(f"{module.served_name(family)}={directory}")


if __name__ == "__main__":
    main()
