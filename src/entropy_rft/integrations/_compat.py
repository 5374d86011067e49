"""Version checks shared by the engine integrations (each overrides a tested range of an engine's internals)."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version


def release_tuple(version: str) -> tuple[int, int, int]:
    """(major, minor, micro) of ``version``; local and pre-release parts are ignored ('1.16.0+cpu' -> (1, 16, 0))."""
    try:
        rel = Version(version).release
    except InvalidVersion:
        return (0, 0, 0)
    return tuple((list(rel) + [0, 0, 0])[:3])  # type: ignore[return-value]


def in_range(version: str, lo: tuple[int, ...], hi_exclusive: tuple[int, ...]) -> bool:
    """Whether ``version`` lies in [lo, hi_exclusive)."""
    return lo <= release_tuple(version) < hi_exclusive


def require_version(package: str, version: str, lo: tuple[int, ...], hi_exclusive: tuple[int, ...],
                    why: str = "", hint: str = "") -> None:
    """Raise ImportError unless ``package``'s ``version`` lies in the tested range [lo, hi_exclusive).

    The message names the integration (``entropy_rft.integrations.<package>``) and the pip spec to install;
    ``why`` follows the spec, ``hint`` the pip command.
    """
    if not in_range(version, lo, hi_exclusive):
        spec = f"{package}>={'.'.join(map(str, lo))},<{'.'.join(map(str, hi_exclusive))}"
        raise ImportError(f"entropy_rft.integrations.{package} supports {spec}{why}; found {package} {version}. "
                          f"Install a tested version: pip install '{spec}'{hint}")


# TRL versions the TRL integration was tested with: it overrides private methods of GRPOTrainer, whose signatures
# change between minor releases.
TRL_MIN, TRL_MAX_EXCLUSIVE = (1, 16, 0), (1, 17, 0)


def check_trl_version(version: str) -> None:
    """Raise ImportError unless TRL ``version`` lies in the tested range [TRL_MIN, TRL_MAX_EXCLUSIVE)."""
    require_version("trl", version, TRL_MIN, TRL_MAX_EXCLUSIVE, why=" (it overrides GRPOTrainer internals)")
