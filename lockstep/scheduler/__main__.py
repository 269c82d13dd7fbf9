"""`python -m lockstep.scheduler`: the scheduler process, serving the engines the config names.

The one module of the scheduler package that knows the engine backends: it hands
`lockstep.backends.start_engines` to `server.serve`, which only sees the engine contract.
"""

from __future__ import annotations

import functools
import logging

from lockstep import backends, runtime
from lockstep.scheduler.server import parse_args, serve


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [scheduler] %(name)s: %(message)s"
    )
    cfg = parse_args(argv)
    start_engines = functools.partial(
        backends.start_engines,
        cfg.engine,
        cfg.sampler,
        cfg.model_dir,
        cfg.served_names[0],
        cfg.data_dir,
    )
    runtime.run(serve(cfg, start_engines))


if __name__ == "__main__":
    main()
