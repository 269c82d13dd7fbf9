"""Build the tiny random models of the architectures Lockstep trains (lockstep/modeling/zoo.py).

    python scripts/build_tiny_models.py DIR [FAMILY ...]     # default: every family
    lockstep serve --model Lockstep/tiny-qwen3-moe=DIR/tiny-qwen3_moe-<digest>

Offline (the built-in tokenizer, transformers configs, name-seeded weights). Idempotent and
atomic: a finished model directory is reused; prints each family's directory and served name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.modeling import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "families", nargs="*", metavar="FAMILY", help=", ".join(sorted(zoo.FAMILIES))
    )
    args = parser.parse_args()
    unknown = sorted(set(args.families) - set(zoo.FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(sorted(zoo.FAMILIES))}")
    for family in args.families or sorted(zoo.FAMILIES):
        directory = zoo.ensure_family(family, args.out_dir)
        print(f"{zoo.served_name(family)}={directory}")


if __name__ == "__main__":
    main()
