"""`lockstep demo`: start the service and train several tenants at once through the tinker SDK."""

from lockstep.demo.data import PIG_LATIN, quickstart_data
from lockstep.demo.run import run_demo

__all__ = ["PIG_LATIN", "quickstart_data", "run_demo"]
