/* What the fuzz targets read their inputs as: a script of small unsigned numbers, little-endian,
 * zeros once it runs out. */
#ifndef OVERCAST_TESTS_SCRIPT_H
#define OVERCAST_TESTS_SCRIPT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const uint8_t *p;
    size_t left;
} script;

static inline unsigned take(script *s, unsigned bytes) {
    unsigned v = 0;
    for (unsigned i = 0; i < bytes && s->left; i++, s->left--) v |= (unsigned)*s->p++ << (8 * i);
    return v;
}

#endif
