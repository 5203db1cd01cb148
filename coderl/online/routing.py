"""Per-population adapters behind one endpoint: which weights answer a request.

A :class:`Router` maps a request's population to a :class:`Route`: the sampler that answers,
its registry version and the adapter name recorded with the interaction
(``<population>@v<version>``, ``shared@v<version>`` for the shared route). A population with
an own champion in the registry (:meth:`coderl.online.registry.Registry.own_champions`) has its
own route; every other request (a population without enough data for an own adapter, one
nobody configured, or none at all) takes the shared route. A route is only ever replaced by
the same population's next champion (:func:`refresh`), so one population's adapter is never
served to another, and a promotion swaps one route while the others keep answering.

Samplers: with ``engine.kind=torch`` each route is its own in-process policy (the base weights
are held once per route: memory grows with the number of populations); with ``vllm`` every
route is an adapter of the same server (multi-LoRA: vLLM batches requests of different
adapters together), loaded by :meth:`coderl.policy.vllm_engine.VLLMEngine.load_adapter` and
named per population.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coderl.config.online import SHARED

if TYPE_CHECKING:
    from coderl.online.registry import Registry


def adapter_label(population: str, version: int) -> str:
    """The adapter name recorded with an interaction: ``<population>@v<version>``."""
    return f"{population}@v{version}"


@dataclass(frozen=True)
class Route:
    sampler: Any
    """What samples: ``generate(prompts, params)`` with exact logprobs and a ``tokenizer``."""
    version: int
    """The registry version of its weights."""
    population: str = SHARED
    """:data:`SHARED` or the population whose own champion this is."""

    @property
    def adapter(self) -> str:
        return adapter_label(self.population, self.version)


class Router:
    """Population -> route; thread-safe (the server answers requests from a thread pool)."""

    def __init__(self, shared: Route) -> None:
        if shared.population != SHARED:
            raise ValueError(f"the shared route must be {SHARED!r}, not {shared.population!r}")
        self._routes: dict[str, Route] = {SHARED: shared}
        self._lock = threading.Lock()

    def route(self, population: str | None) -> Route:
        """The route of ``population``: its own, else the shared one."""
        with self._lock:
            return self._routes.get(population or SHARED, self._routes[SHARED])

    def set(self, route: Route) -> Route | None:
        """Serve ``route`` to its population from the next request on; returns the route it
        replaced (None: the population had none)."""
        with self._lock:
            previous = self._routes.get(route.population)
            self._routes[route.population] = route
        return previous

    def routes(self) -> dict[str, Route]:
        """A snapshot: population -> route (``shared`` included)."""
        with self._lock:
            return dict(self._routes)


def refresh(router: Router, registry: Registry, load: Callable[[str, int], Any]) -> list[str]:
    """Bring every route to the registry's champion pointers: a pointer that moved gets a
    route on its new version (``load(population, version)`` returns the sampler); the others
    are left as they are.

    Returns:
        the populations (``shared`` included) whose route changed, sorted.
    """
    wanted: dict[str, int | None] = {SHARED: registry.champion(), **registry.own_champions()}
    current = router.routes()
    changed = []
    for population, version in sorted(wanted.items()):
        if version is None or (population in current and current[population].version == version):
            continue
        router.set(Route(load(population, version), version, population))
        changed.append(population)
    return changed
