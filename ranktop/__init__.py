"""ranktop: launch, watch and debug the ranks of a distributed training job.

The engine is `ranktop.core` (from the `core/` folder) and the terminal UI `ranktop.tui` (from
`tui/`); they are installed under this name so that a user project with its own `core` or `tui`
package never shadows them, in the caller or in a rank.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ranktop")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
