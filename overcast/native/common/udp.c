#define _GNU_SOURCE
#include "udp.h"

#include <errno.h>
#include <netinet/udp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

int oc_udp_init(oc_udp *u, int fd) {
    memset(u, 0, sizeof *u);
    u->fd = fd;
    u->gso = 1;
    int one = 1;
    u->gro = setsockopt(fd, SOL_UDP, UDP_GRO, &one, sizeof one) == 0;
    u->buf = malloc(OC_GRO_READ_BYTES);
    return u->buf ? 0 : -1;
}

void oc_udp_free(oc_udp *u) {
    free(u->buf);
    u->buf = NULL;
}

ssize_t oc_udp_read(oc_udp *u, size_t *segment, int *misfit) {
    struct iovec iov = {u->buf, OC_GRO_READ_BYTES};
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } control;
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.buf;
    msg.msg_controllen = sizeof control.buf;
    ssize_t n = recvmsg(u->fd, &msg, MSG_DONTWAIT);
    *misfit = OC_UDP_WHOLE;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
    u->reads++;
    if (n == 0) {
        *misfit = OC_UDP_EMPTY;
        return -1;
    }
    size_t size = (size_t)n;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO &&
            c->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int s;
            memcpy(&s, CMSG_DATA(c), sizeof s);
            if (s > 0) size = (size_t)s;
        }
    }
    if (msg.msg_flags & MSG_TRUNC) { /* the segment the buffer cut; any after it never came */
        u->truncated++;
        *misfit = OC_UDP_TRUNCATED;
        n = size < (size_t)n ? n - (ssize_t)((size_t)n % size) : 0;
        if (n == 0) return -1; /* nothing whole in it; more may be waiting */
    }
    if (n > 0) {
        u->datagrams_in += ((size_t)n + size - 1) / size;
        u->bytes_in += (uint64_t)n;
    }
    *segment = size ? size : 1;
    return n;
}

static void count_out(oc_udp *u, size_t bytes, size_t segment) {
    u->datagrams_out += (bytes + segment - 1) / segment;
    u->bytes_out += bytes;
}

/* The datagrams from `sent` on are lost to an error: counted, and dealt with. */
static ssize_t lost(oc_udp *u, size_t len, size_t segment, size_t sent) {
    u->send_errors += (len - sent + segment - 1) / segment;
    return (ssize_t)len;
}

ssize_t oc_udp_send(oc_udp *u, const uint8_t *data, size_t len, size_t segment,
                    const struct sockaddr_in *to) {
    size_t sent = 0;
    if (len > segment && u->gso) {
        struct iovec iov = {(void *)data, len};
        union { char buf[CMSG_SPACE(sizeof(uint16_t))]; struct cmsghdr align; } control;
        memset(&control, 0, sizeof control);
        struct msghdr msg = {0};
        msg.msg_name = (void *)to;
        msg.msg_namelen = sizeof *to;
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_UDP;
        c->cmsg_type = UDP_SEGMENT;
        c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        uint16_t s = (uint16_t)segment;
        memcpy(CMSG_DATA(c), &s, sizeof s);
        u->sends++;
        ssize_t n = sendmsg(u->fd, &msg, MSG_DONTWAIT);
        if (n >= 0) {
            count_out(u, (size_t)n, segment);
            return n;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        if (errno == EIO || errno == EINVAL || errno == EOPNOTSUPP || errno == ENOPROTOOPT)
            u->gso = 0; /* the kernel or device will not segment: one by one from now on */
        else if (errno != EMSGSIZE) /* this batch was too large, not the device: one by one */
            return lost(u, len, segment, 0);
    }
    while (sent < len) {
        size_t n = len - sent < segment ? len - sent : segment;
        u->sends++;
        ssize_t got = sendto(u->fd, data + sent, n, MSG_DONTWAIT, (const struct sockaddr *)to,
                             sizeof *to);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            return lost(u, len, segment, sent);
        }
        count_out(u, (size_t)got, segment);
        sent += n;
    }
    return (ssize_t)sent;
}
