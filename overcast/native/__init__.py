"""overcast's native core: the per-datagram data path in C (the aggregator's today).

The package's own build compiles it (setup.py: `pip install -e .`, which tools/setup runs).
Each part has a header of its own in this folder: wire.h (header, AES-GMAC, replay window),
sums.h (sums by dtype), udp.h (GRO/GSO batches), aggregator.h (the sans-I/O reduction engine)
and service.h (its socket loop); module.c is the Python binding.
"""

try:
    from overcast.native._core import (EXPIRY_SECONDS, MAX_REDUCTIONS,  # noqa: F401
                                       MAX_RESEND_SECONDS, RESEND_SECONDS, Aggregator)
except ImportError as err:  # pragma: no cover - a build problem, said plainly
    raise ImportError(f"overcast's native core is not built ({err}); run tools/setup, or "
                      f"`pip install -e .` in the repository") from err
