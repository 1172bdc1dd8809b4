#define _GNU_SOURCE
#include "port.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "common/clock.h"

#define MAX_WAIT_SECONDS 0.5
/* Reads per socket before the loop looks at the timers and the rest again. */
#define READS_PER_WAKEUP 64

enum { TAG_UDP = 1, TAG_GROUP = 2, TAG_PYTHON = 3 };

int oc_port_init(oc_port *port, oc_plane *plane, int udp_fd, int group_fd, int python_fd) {
    memset(port, 0, sizeof *port);
    port->plane = plane;
    port->group.fd = -1;
    port->epoll = epoll_create1(EPOLL_CLOEXEC);
    if (port->epoll < 0) return -1;
    if (oc_udp_init(&port->udp, udp_fd) || (group_fd >= 0 && oc_udp_init(&port->group, group_fd))) {
        oc_port_free(port);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.u32 = TAG_UDP};
    int failed = epoll_ctl(port->epoll, EPOLL_CTL_ADD, udp_fd, &ev);
    ev.data.u32 = TAG_GROUP;
    if (!failed && group_fd >= 0) failed = epoll_ctl(port->epoll, EPOLL_CTL_ADD, group_fd, &ev);
    ev.data.u32 = TAG_PYTHON;
    if (!failed) failed = epoll_ctl(port->epoll, EPOLL_CTL_ADD, python_fd, &ev);
    if (failed) {
        int saved = errno;
        oc_port_free(port);
        errno = saved;
        return -1;
    }
    return 0;
}

void oc_port_free(oc_port *port) {
    if (port->epoll >= 0) close(port->epoll);
    port->epoll = -1;
    oc_udp_free(&port->udp);
    if (port->group.fd >= 0) oc_udp_free(&port->group);
    port->group.fd = -1;
    for (size_t i = 0; i < port->npending; i++) free(port->pending[i].data);
    free(port->pending);
    port->pending = NULL;
    port->npending = port->pending_cap = port->pending_bytes = 0;
}

static void keep(oc_port *port, uint8_t route, uint16_t dst, const uint8_t *data, size_t len,
                 size_t segment) {
    if (port->pending_bytes + len > OC_PORT_PENDING_BYTES) {
        /* a socket that has stayed full this long: what does not fit is lost, as on a link */
        oc_plane_drops_mut(port->plane)[OC_PLANE_DROP_send_buffer_full] +=
            (len + segment - 1) / segment;
        return;
    }
    if (port->npending == port->pending_cap) {
        size_t cap = port->pending_cap ? 2 * port->pending_cap : 16;
        oc_pending *q = realloc(port->pending, cap * sizeof *q);
        if (q == NULL) goto lost;
        port->pending = q;
        port->pending_cap = cap;
    }
    uint8_t *copy = malloc(len);
    if (copy == NULL) goto lost;
    memcpy(copy, data, len);
    port->pending[port->npending++] = (oc_pending){route, dst, len, segment, copy};
    port->pending_bytes += len;
    return;
lost: /* no memory: the datagrams are lost, as on a link; the protocols repair them */
    oc_plane_drops_mut(port->plane)[OC_PLANE_DROP_send_error]++;
}

/* Send a batch; 0 if it all went (or failed for good), 1 if the socket is full. */
static int send_batch(oc_port *port, uint8_t route, uint16_t dst, const uint8_t *data,
                      size_t len, size_t segment, size_t *sent) {
    const struct sockaddr_in *to = oc_plane_address(port->plane, route, dst);
    uint64_t *drops = oc_plane_drops_mut(port->plane), *stats = oc_plane_stats(port->plane);
    *sent = 0;
    if (to == NULL) {
        drops[OC_PLANE_DROP_send_error]++;
        return 0;
    }
    uint64_t sends = port->udp.sends, errors = port->udp.send_errors, out = port->udp.bytes_out;
    size_t n = (size_t)oc_udp_send(&port->udp, data, len, segment, to);
    stats[OC_PLANE_STAT_datagram_sends] += port->udp.sends - sends;
    drops[OC_PLANE_DROP_send_error] += port->udp.send_errors - errors;
    stats[OC_PLANE_STAT_datagram_bytes_out] += port->udp.bytes_out - out;
    *sent = n;
    return n < len;
}

static void emit(void *ctx, uint8_t route, uint16_t dst, const uint8_t *data, size_t len,
                 size_t segment) {
    oc_port *port = ctx;
    size_t sent = 0;
    if (port->npending == 0 && !send_batch(port, route, dst, data, len, segment, &sent)) return;
    keep(port, route, dst, data + sent, len - sent, segment);
}

/* Send what waits, in order, until the socket is full. */
static void send_pending(oc_port *port) {
    size_t done = 0;
    while (done < port->npending) {
        oc_pending *q = &port->pending[done];
        size_t sent;
        int full = send_batch(port, q->route, q->dst, q->data, q->len, q->segment, &sent);
        if (full) {
            port->pending_bytes -= sent;
            memmove(q->data, q->data + sent, q->len - sent);
            q->len -= sent;
            break;
        }
        port->pending_bytes -= q->len; /* sent, or failed for good (counted) */
        free(q->data);
        done++;
    }
    memmove(port->pending, port->pending + done, (port->npending - done) * sizeof(oc_pending));
    port->npending -= done;
}

void oc_port_flush(oc_port *port) {
    oc_sealer *s = oc_plane_sealer(port->plane);
    oc_outbox *o = oc_plane_outbox(port->plane);
    if (port->npending) send_pending(port);
    if (s == NULL) {
        oc_outbox_clear(o);
        return;
    }
    oc_trace *t = oc_plane_trace(port->plane);
    if (t->bin_seconds > 0) {
        double now = oc_monotonic();
        for (const oc_msg *m = o->msgs; m < o->msgs + o->n; m++)
            oc_trace_count(t, 1, m->seq, 1, m->head_len + m->body_len, now);
    }
    oc_plane_drops_mut(port->plane)[OC_PLANE_DROP_unsealable] += oc_outbox_seal(o, s, emit, port);
    int want = port->npending > 0;
    if (want != port->writing) {
        struct epoll_event ev = {.events = EPOLLIN | (want ? EPOLLOUT : 0), .data.u32 = TAG_UDP};
        if (epoll_ctl(port->epoll, EPOLL_CTL_MOD, port->udp.fd, &ev) == 0) port->writing = want;
    }
}

/* Read one socket until it is empty, a read leaves runs for Python, or enough reads. 1 if it
 * left runs. */
static int read_socket(oc_port *port, oc_udp *u) {
    oc_plane *p = port->plane;
    for (int reads = 0; reads < READS_PER_WAKEUP; reads++) {
        size_t segment;
        int misfit;
        ssize_t got = oc_udp_read(u, &segment, &misfit);
        if (misfit == OC_UDP_TRUNCATED) oc_plane_drops_mut(p)[OC_PLANE_DROP_truncated]++;
        if (misfit == OC_UDP_EMPTY) oc_plane_drops_mut(p)[OC_PLANE_DROP_malformed]++;
        if (got == 0) return 0;
        if (got < 0) continue;
        oc_plane_feed(p, u->buf, (size_t)got, segment, oc_monotonic());
        const oc_run *runs;
        const uint32_t *chunks;
        if (oc_plane_runs(p, &runs, &chunks)) {
            port->runs_data = u->buf;
            port->runs_len = (size_t)got;
            return 1;
        }
    }
    return 0;
}

int oc_port_serve(oc_port *port, double until) {
    oc_plane *p = port->plane;
    double cpu0 = oc_thread_cpu();
    int result = -1;
    oc_plane_clear_runs(p);
    for (int looked = 0; result < 0; looked = 1) {
        double now = oc_monotonic();
        double timer = oc_plane_timer(p);
        if (timer >= 0 && now >= timer) {
            oc_plane_handle_timer(p, now);
            timer = oc_plane_timer(p);
        }
        oc_port_flush(port);
        if (oc_plane_has_news(p)) {
            result = OC_PORT_NEWS;
            break;
        }
        if (now >= until && looked) {
            result = OC_PORT_DEADLINE;
            break;
        }
        double wait = now < until ? until - now : 0;
        if (timer >= 0 && timer - now < wait) wait = timer > now ? timer - now : 0;
        if (wait > MAX_WAIT_SECONDS) wait = MAX_WAIT_SECONDS;
        struct epoll_event ready[4];
        int n = epoll_wait(port->epoll, ready, 4, (int)(wait * 1000 + 0.999));
        port->wakeups++;
        if (n < 0) {
            result = errno == EINTR ? OC_PORT_INTERRUPTED : OC_PORT_ERROR;
            break;
        }
        int python = 0, udp = 0, group = 0, writable = 0;
        for (int i = 0; i < n; i++) {
            if (ready[i].data.u32 == TAG_PYTHON) python = 1;
            if (ready[i].data.u32 == TAG_UDP) {
                udp = (ready[i].events & EPOLLIN) != 0;
                writable = (ready[i].events & EPOLLOUT) != 0;
            }
            if (ready[i].data.u32 == TAG_GROUP) group = 1;
        }
        if (writable) oc_port_flush(port);
        /* datagrams before Python's descriptors: a root's end-of-multicast notice on its stream
         * must not overtake its last chunks already waiting in the socket */
        if ((udp && read_socket(port, &port->udp)) ||
            (group && read_socket(port, &port->group))) {
            result = OC_PORT_RUNS;
            break;
        }
        if (python) result = OC_PORT_PYTHON;
    }
    oc_port_flush(port);
    port->cpu_seconds += oc_thread_cpu() - cpu0;
    return result;
}
