/* Little-endian integers in byte arrays, as the wire lays out every header field and payload
 * number: read from and written to any address (no alignment assumed), whatever the host's
 * byte order. The caller bounds-checks: each reads or writes exactly 2, 4 or 8 bytes at p.
 * Nothing is kept. */
#ifndef OVERCAST_NATIVE_BYTES_H
#define OVERCAST_NATIVE_BYTES_H

#include <stdint.h>

static inline uint16_t oc_get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t oc_get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t oc_get64(const uint8_t *p) {
    return oc_get32(p) | (uint64_t)oc_get32(p + 4) << 32;
}

static inline void oc_put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void oc_put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void oc_put64(uint8_t *p, uint64_t v) {
    oc_put32(p, (uint32_t)v);
    oc_put32(p + 4, (uint32_t)(v >> 32));
}

#endif
