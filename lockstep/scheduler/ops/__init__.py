"""One op kind, one home: each module here holds everything one op kind does (see base.py).

    create.py            create_model                  PRE, alone
    load.py              load_state, create-via-load   PRE, alone
    forward_backward.py  forward, forward_backward     the ONE fused pass
    optim_step.py        optim_step                    the ONE batched optimizer step
    save.py              save_weights (all kinds)      PRE or POST, alone
    sample.py            sample                        the sampling lane
    refused.py           refused (queued "rejected")   holds its seq_id only

`registry.py` maps the SubmitRequest oneof and the queued kind to its module; an op may bring a
kind and an engine verb of its own (docs/ARCHITECTURE.md, "Adding an op").
"""
