/* Growing an array the core owns: doubling, so n appends cost O(n). The array (*p: NULL or from
 * malloc) stays its owner's, who frees it; a failed growth leaves it as it was. */
#ifndef OVERCAST_NATIVE_GROW_H
#define OVERCAST_NATIVE_GROW_H

#include <stdlib.h>

/* Make room for `need` elements of `size` bytes in *p (capacity *cap): 0, or -1 with *p
 * untouched if memory ran out. */
static inline int oc_grow(void **p, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *q = realloc(*p, n * size);
    if (q == NULL) return -1;
    *p = q;
    *cap = n;
    return 0;
}

#endif
