/* Batched UDP I/O on one socket: a read takes what the kernel coalesced (UDP GRO) and reports
 * the segment size; a send hands the kernel datagrams laid back to back to cut (UDP GSO), one by
 * one where the kernel or device will not segment them. The socket is the caller's (not
 * closed here); the read buffer is owned. */
#ifndef OVERCAST_NATIVE_UDP_H
#define OVERCAST_NATIVE_UDP_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define OC_GSO_MAX_SEGMENTS 64
#define OC_GSO_MAX_BYTES 65507 /* one UDP payload */
#define OC_GRO_READ_BYTES 65536

/* Whether a datagram of `len` bytes may follow `end` bytes of datagrams of `segment` bytes in
 * one GSO send: the kernel cuts a send at `segment`, so only the last may be shorter. */
static inline int oc_gso_joins(size_t end, size_t segment, size_t len) {
    return end == 0 || (len <= segment && end % segment == 0 && end + len <= OC_GSO_MAX_BYTES &&
                        end / segment < OC_GSO_MAX_SEGMENTS);
}

typedef struct {
    int fd;
    int gro, gso;
    uint8_t *buf;   /* owned, OC_GRO_READ_BYTES */
    uint64_t reads, sends, datagrams_in, datagrams_out, bytes_in, bytes_out, truncated;
    uint64_t send_errors;   /* datagrams lost to an error of the socket (not a full one) */
} oc_udp;

int oc_udp_init(oc_udp *u, int fd);
void oc_udp_free(oc_udp *u);
/* One read into u->buf: its length (> 0), with *segment the size of every datagram in it but
 * the last; 0 when nothing is waiting; -1 for a read to pass over (an ICMP report of an earlier
 * send, or nothing whole in it). *misfit says what the caller drops and counts: a datagram the
 * buffer cut short (left out), or an empty datagram (which must not read as "nothing waiting",
 * or anyone could end a read burst with one). */
enum { OC_UDP_WHOLE, OC_UDP_TRUNCATED, OC_UDP_EMPTY };
ssize_t oc_udp_read(oc_udp *u, size_t *segment, int *misfit);
/* Send `len` bytes of datagrams, each `segment` bytes but the last, to `to`, until the socket is
 * full: the bytes dealt with (whole datagrams), fewer than `len` only when the socket is full.
 * A datagram an error refuses, and those after it in the batch, are lost as on a link and
 * counted in send_errors. A GSO send the device cannot segment turns GSO off for the socket;
 * one the kernel finds too large (EMSGSIZE) goes one datagram at a time, GSO kept. */
ssize_t oc_udp_send(oc_udp *u, const uint8_t *data, size_t len, size_t segment,
                    const struct sockaddr_in *to);

#endif
