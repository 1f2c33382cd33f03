"""Keyword arguments that drift between Megatron tags, forwarded without silent drops.

The TE wrappers' constructors gain keywords at almost every tag (``tp_group`` in 0.13,
``stride`` in 0.16, ``name`` in 0.18, ``pg_collection`` on main, ...). Our modules accept the
union and forward to the running tree's local classes only what that tree's signature knows.
A keyword the running tree cannot honour is dropped only when it carries its "not used" value
(``None``, or a default the caller did not change); anything else is an error naming it,
because silently ignoring a user's setting is worse than failing. ``reject`` is that error's
one line, and ``refuse_te_only_config`` raises it for the config fields no native linear,
grouped or not, can honour.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any


@functools.cache
def _parameters(func: Callable[..., Any]) -> tuple[frozenset[str], bool]:
    params = inspect.signature(func).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return frozenset(params), var_kw


def accepted_kwargs(
    func: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *,
    owner: str,
    inert: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``func`` accepts.

    A keyword ``func`` does not know is dropped when its value is None or equals its entry in
    ``inert`` (the value meaning "feature off"); otherwise ``ValueError`` says which keyword of
    ``owner`` this Megatron version cannot use.
    """
    names, var_kw = _parameters(func)
    if var_kw:
        return dict(kwargs)
    inert = inert or {}
    kept: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in names:
            kept[key] = value
        elif value is None or (key in inert and value == inert[key]):
            continue
        else:
            raise ValueError(
                f"{owner}: {key}={value!r} is not supported by megatron-rocm's native "
                f"TransformerEngine backend with this Megatron version"
            )
    return kept


def reject(owner: str, what: str, instead: str) -> None:
    """Raise the one-line error every unsupported TE feature gets."""
    raise ValueError(f"{owner}: {what} needs TransformerEngine, which is not installed; {instead}")


# Config fields TE's linears honour and these cannot, grouped or not: (field, what it is, what
# to do instead). Argument validation refuses their flags (``options``); this is for models built
# without it.
_TE_ONLY_CONFIG = (
    (
        "quant_recipe",
        "a per-module precision recipe (--te-precision-config-file)",
        "remove it and train in bf16",
    ),
    (
        "use_te_activation_func",
        "TE's activation ops (--use-te-activation-func)",
        "remove it (the MLP then applies its activation natively)",
    ),
)


def refuse_te_only_config(owner: str, config: Any) -> None:
    """One line for the first config field set that only TE's linears can honour."""
    for field, what, instead in _TE_ONLY_CONFIG:
        if getattr(config, field, None):
            reject(owner, what, instead)
