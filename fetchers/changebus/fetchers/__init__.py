"""changebus.fetchers: change sources that feed the relay.

The :class:`Fetcher` protocol, the :class:`Window` and :class:`ResumePoint`
values it exchanges with the relay, and the registry of fetcher kinds:
plugins declared in the ``changebus.fetchers`` entry-point group (changebus
declares ``synthetic``, ``postgres`` and ``mysql``), each imported when a
relay config first names it, plus kinds registered in process with
:func:`register_fetcher`. :func:`check_source` is the preflight of a Postgres
or MariaDB/MySQL source (``changebus check-source``), returning a
:class:`CheckReport` of :class:`Finding`\\ s.
"""

from typing import TYPE_CHECKING, Any, Final

from ._base import (
    Fetcher as Fetcher,
    FetcherFactory as FetcherFactory,
    ResumePoint as ResumePoint,
    Window as Window,
    WindowFeed as WindowFeed,
    create_fetcher as create_fetcher,
    fetcher_kinds as fetcher_kinds,
    register_fetcher as register_fetcher,
    window_bytes as window_bytes,
)

if TYPE_CHECKING:
    from ._check import (
        CheckReport as CheckReport,
        Finding as Finding,
        Level as Level,
        check_source as check_source,
    )
    from ._policy import (
        ColumnPolicy as ColumnPolicy,
        ColumnPolicyOptions as ColumnPolicyOptions,
        ColumnRule as ColumnRule,
        TablePlan as TablePlan,
        canonical_bytes as canonical_bytes,
    )

#: names of :mod:`._policy` and :mod:`._check`, imported on first use: importing the
#: registry loads no more than it (tests/test_layering.py)
_LAZY: Final = frozenset(
    {"ColumnPolicy", "ColumnPolicyOptions", "ColumnRule", "TablePlan", "canonical_bytes"}
)
_LAZY_CHECK: Final = frozenset({"CheckReport", "Finding", "Level", "check_source"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import _policy

        return getattr(_policy, name)
    if name in _LAZY_CHECK:
        from . import _check

        return getattr(_check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckReport",
    "ColumnPolicy",
    "ColumnPolicyOptions",
    "ColumnRule",
    "Fetcher",
    "FetcherFactory",
    "Finding",
    "Level",
    "ResumePoint",
    "TablePlan",
    "Window",
    "canonical_bytes",
    "check_source",
    "create_fetcher",
    "fetcher_kinds",
    "register_fetcher",
    "window_bytes",
]
