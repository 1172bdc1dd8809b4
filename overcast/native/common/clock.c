#define _GNU_SOURCE
#include "clock.h"

#include <time.h>

static double seconds(clockid_t id) {
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

double oc_monotonic(void) { return seconds(CLOCK_MONOTONIC); }

double oc_thread_cpu(void) { return seconds(CLOCK_THREAD_CPUTIME_ID); }
