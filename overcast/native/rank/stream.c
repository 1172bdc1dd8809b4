#include "stream.h"

size_t oc_stream_open(oc_stream_in *in, oc_gmac *g, const uint8_t *buf, size_t len,
                      oc_frame *frames, size_t max, size_t *used, size_t *need, int *fault) {
    size_t pos = 0, n = 0;
    *need = 0;
    *fault = 0;
    while (n < max) {
        size_t left = len - pos;
        if (left < OC_HEADER_BYTES) {
            *need = OC_HEADER_BYTES - left;
            break;
        }
        oc_header h;
        if (oc_header_parse(buf + pos, left, &h)) {
            *fault = OC_MISFIT_MALFORMED;
            break;
        }
        if (h.src != in->peer) {
            *fault = OC_MISFIT_WRONG_SENDER;
            break;
        }
        size_t total = (size_t)h.length + OC_OVERHEAD_BYTES; /* length <= OC_MAX_PAYLOAD */
        if (left < total) {
            *need = total - left;
            break;
        }
        const uint8_t *m = buf + pos;
        pos += total;
        if (h.job != in->job || h.comm != in->comm) {
            in->foreign++;
        } else if (!oc_gmac_check(g, h.src, h.counter, m, total - OC_TAG_BYTES,
                                  m + total - OC_TAG_BYTES)) {
            in->bad_mac++;
        } else if (h.counter < in->next_counter || h.counter == UINT64_MAX) {
            in->replayed++; /* UINT64_MAX would leave no counter above it */
        } else {
            in->next_counter = h.counter + 1;
            frames[n].h = h;
            frames[n].payload = (size_t)(m - buf) + OC_HEADER_BYTES;
            n++;
        }
    }
    *used = pos;
    return n;
}
