"""An op added the way a contributor adds one (docs/ARCHITECTURE.md, "Adding an op"): its
proto messages (`PROTO`), its two op modules, a line in each registry, and its engine verb in
the engines that serve it. Driven by tests/integration/test_adding_an_op.py."""
