/* The aggregator's data path on its socket: read GRO batches, feed the engine, send what it
 * wants sent in GSO batches, wake for its timer. Runs until a control descriptor (the
 * registration listener and connections, which stay Python) has something to read, a signal
 * interrupts it, or a deadline passes; then the caller handles that and calls it again. It
 * touches no Python object and is run with the GIL released. */
#ifndef OVERCAST_NATIVE_SERVICE_H
#define OVERCAST_NATIVE_SERVICE_H

#include "aggregator.h"
#include "udp.h"

enum { OC_SERVE_DEADLINE = -1, OC_SERVE_INTERRUPTED = -2, OC_SERVE_ERROR = -3 };

/* The seconds of CPU this thread has spent inside oc_serve (its clock read once per call, at
 * the start and the end: reading it is a system call), and its wake-ups. */
typedef struct {
    double cpu_seconds;
    uint64_t wakeups;
} oc_serve_stats;

/* The index of a readable control descriptor, or OC_SERVE_DEADLINE when the monotonic clock
 * reaches `until`, OC_SERVE_INTERRUPTED on a signal, OC_SERVE_ERROR if epoll fails. */
int oc_serve(oc_agg *a, oc_udp *u, const int *control, int ncontrol, double until,
             oc_serve_stats *stats);

/* The monotonic clock in seconds (Python's time.monotonic). */
double oc_monotonic(void);

#endif
