/* The clocks both sides read: the monotonic clock, which every deadline and timer of the core is
 * in (Python's time.monotonic, so the two compare), and the calling thread's CPU time, which the
 * serving loops count themselves in. Each read is a system call (vDSO for the monotonic one).
 * Nothing is kept: no state, no ownership. */
#ifndef OVERCAST_NATIVE_CLOCK_H
#define OVERCAST_NATIVE_CLOCK_H

/* The monotonic clock in seconds. */
double oc_monotonic(void);
/* The seconds of CPU the calling thread has spent. */
double oc_thread_cpu(void);

#endif
