"""The running Lockstep version: declared once, in pyproject.toml, and read here from the installed
package's metadata (what `lockstep --version`, `/api/v1/healthz`, `get_server_capabilities`, the
`lockstep_build_info` metric and the state stamps report). CHANGELOG.md names the commit each
release was cut from."""

from __future__ import annotations

from importlib import metadata

try:
    VERSION = metadata.version("lockstep")
except metadata.PackageNotFoundError:  # a source checkout that was never installed
    VERSION = "unknown"

# The format of the state this release writes: the Redis keys (`scheduler/state/keys.py`) and the
# data directory's layout. Stamped beside the state and checked at every start
# (`scheduler/state/format.py`); a release that changes either moves it and adds a migration
# from the previous format (`scheduler/state/migrations.py`).
STATE_FORMAT = 2
