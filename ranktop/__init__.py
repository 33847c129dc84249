"""ranktop: launch, watch and debug the ranks of a distributed training job.

The engine is `ranktop.core` (from the `core/` folder) and the terminal UI `ranktop.tui` (from
`tui/`); they are installed under this name so that a user project with its own `core` or `tui`
package never shadows them, in the caller or in a rank.
"""



def __getattr__(name: str) -> str:
    # Read on first use only: importlib.metadata costs ~60 ms at start-up, before any rank starts.
    if name != "__version__":
        raise AttributeError(f"module 'ranktop' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ranktop")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
