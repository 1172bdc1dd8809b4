#define _GNU_SOURCE
#include "service.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <time.h>

/* Reads taken before what they produced is sent: results of several reads leave together. A
 * wake-up reads at most READS_PER_WAKEUP times before it looks at the control descriptors. */
#define READS_PER_FLUSH 64
#define READS_PER_WAKEUP 256
#define MAX_WAIT_SECONDS 0.5

double oc_monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double thread_cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

typedef struct {
    oc_agg *agg;
    oc_udp *udp;
} sender;

/* Send a sealed batch to every address of its destination. A socket too full to take it drops
 * what did not go, as a switch port would: the ranks ask again. */
static void send_batch(void *ctx, int handle, uint16_t dst, const uint8_t *data, size_t len,
                       size_t segment) {
    sender *s = ctx;
    struct sockaddr_in to[256];
    size_t n = oc_agg_destinations(s->agg, handle, dst, to, sizeof to / sizeof to[0]);
    uint64_t *drops = oc_agg_drops_mut(s->agg);
    for (size_t i = 0; i < n; i++) {
        ssize_t sent = oc_udp_send(s->udp, data, len, segment, &to[i]);
        if (sent < 0) drops[OC_DROP_send_error]++;
        else if ((size_t)sent < len) drops[OC_DROP_send_buffer_full] += (len - (size_t)sent + segment - 1) / segment;
    }
}

int oc_serve(oc_agg *a, oc_udp *u, const int *control, int ncontrol, double until,
             oc_serve_stats *stats) {
    struct pollfd *fds = malloc(sizeof(struct pollfd) * (size_t)(1 + ncontrol));
    sender s = {a, u};
    double cpu0 = thread_cpu();
    int result = OC_SERVE_DEADLINE;
    if (fds == NULL) return OC_SERVE_ERROR;
    fds[0].fd = u->fd;
    fds[0].events = POLLIN;
    for (int i = 0; i < ncontrol; i++) {
        fds[1 + i].fd = control[i];
        fds[1 + i].events = POLLIN;
    }
    for (;;) {
        double now = oc_monotonic();
        double timer = oc_agg_timer(a);
        if (timer >= 0 && now >= timer) {
            oc_agg_handle_timer(a, now);
            timer = oc_agg_timer(a);
        }
        oc_agg_flush(a, send_batch, &s);
        if (now >= until) break;
        double wait = until - now;
        if (timer >= 0 && timer - now < wait) wait = timer > now ? timer - now : 0;
        if (wait > MAX_WAIT_SECONDS) wait = MAX_WAIT_SECONDS;
        stats->cpu_seconds += thread_cpu() - cpu0;
        int ready = poll(fds, (nfds_t)(1 + ncontrol), (int)(wait * 1000 + 0.999));
        cpu0 = thread_cpu();
        stats->wakeups++;
        if (ready < 0) {
            result = errno == EINTR ? OC_SERVE_INTERRUPTED : OC_SERVE_ERROR;
            break;
        }
        int readable = -1;
        for (int i = 0; i < ncontrol && readable < 0; i++)
            if (fds[1 + i].revents) readable = i;
        if (fds[0].revents & POLLIN) {
            for (int reads = 0; reads < READS_PER_WAKEUP; reads++) {
                size_t segment;
                int truncated;
                ssize_t n = oc_udp_read(u, &segment, &truncated);
                if (truncated) oc_agg_drops_mut(a)[OC_DROP_truncated]++;
                if (n == 0) break;
                if (n > 0) oc_agg_feed(a, u->buf, (size_t)n, segment, oc_monotonic());
                if (reads % READS_PER_FLUSH == READS_PER_FLUSH - 1) oc_agg_flush(a, send_batch, &s);
            }
            oc_agg_flush(a, send_batch, &s);
        }
        if (readable >= 0) {
            result = readable;
            break;
        }
    }
    stats->cpu_seconds += thread_cpu() - cpu0;
    free(fds);
    return result;
}
