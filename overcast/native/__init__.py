"""overcast's native core: the per-datagram data path in C, of the ranks and of the aggregator.

The package's own build compiles it (setup.py: `pip install -e .`, which tools/setup runs).
Each part has a header of its own, which says who owns what, in a folder by whose code it is
(CONTRIBUTING.md's layout; tests/test_layout.py checks the includes point down these):
common/ what both sides use: wire.h (header, AES-GMAC, replay window), ghash.h (GMAC on
AES-NI), sums.h (sums by dtype), udp.h (GRO/GSO batches), numbering.h (the reduction's chunk
numbering), clock.h, bytes.h (little-endian fields), grow.h; rank/ a rank's: plane.h (its
datagram plane, sans I/O: contribute.h for in-network reductions, gather.h for multicast
gathers, outbox.h for what waits to be sent, trace.h for the timeline), port.h (the plane on
its sockets), stream.h (a stream's frames opened in place), budget.h (a link direction's token
bucket); aggregator/ the aggregator's: aggregator.h (the sans-I/O reduction engine:
aggregator.c and registry.c, sharing state.h), service.h (its socket loop) and shards.h (those
loops on threads, one engine and socket each). parts.txt lists these parts once for every
builder (setup.py, the tests, tools/fuzz, tools/bench_core).

The Python binding, binding/, is module.c (the module, its constants, store_u32_fenced for the
stream gates' word) and a file per type:
bind_wire.c (Sealer, TagCheck), bind_budget.c (Budget), bind_plane.c and bind_gather.c
(Plane), bind_aggregator.c (Aggregator), bind_shards.c (Shards); binding.h holds what they
share; _core.pyi, here beside the module they build, their stubs.
"""

try:
    from overcast.native._core import (
        EXPIRY_SECONDS,
        MAX_REDUCTIONS,
        MAX_RESEND_SECONDS,
        RESEND_SECONDS,
        Aggregator,
        store_u32_fenced,
    )
except ImportError as err:  # pragma: no cover - a build problem, said plainly
    raise ImportError(
        f"overcast's native core is not built ({err}); run tools/setup, or "
        f"`pip install -e .` in the repository"
    ) from err

# what the rest of the library takes from here rather than from _core
__all__ = [
    "EXPIRY_SECONDS",
    "MAX_REDUCTIONS",
    "MAX_RESEND_SECONDS",
    "RESEND_SECONDS",
    "Aggregator",
    "store_u32_fenced",
]
