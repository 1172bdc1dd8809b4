/* Fuzz target: what a hostile peer (or a corrupted connection) could put on a rank's stream. The
 * input is a script of frames: sealed under the communicator's key (a known kind, some under
 * another communicator, some replayed, some with a bit flipped) or raw bytes, back to back, then
 * cut anywhere. It checks that nothing crashes (the sanitizers), that every frame opened is one
 * sealed intact at that offset with a counter above the one before, that nothing is opened past
 * what was consumed or the first fault, and that opening the bytes in two reads (cut anywhere, at
 * most a few frames per call) gives what one read gives. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "script.h"
#include "rank/stream.h"

enum { PEER = 2, CAP = 8192, MAX_FRAMES = CAP / OC_OVERHEAD_BYTES + 1 };
static const uint8_t KEY[16] = {1, 4, 1, 4, 2, 1, 3, 5, 6, 2, 3, 7, 3, 0, 9, 5};
static const uint8_t KINDS[] = {OC_DESCRIBE, OC_ABORT, OC_GOODBYE, OC_RING_DATA, OC_FIN,
                                OC_MCAST_END, OC_REPAIR_REQUEST, OC_REPAIR_DATA, OC_ACTIVATE};

static void fail(const char *why) {
    fprintf(stderr, "%s\n", why);
    abort();
}

static int same_header(const oc_header *a, const oc_header *b) {
    return a->kind == b->kind && a->job == b->job && a->comm == b->comm && a->seq == b->seq &&
           a->src == b->src && a->dst == b->dst && a->chunk == b->chunk &&
           a->length == b->length && a->counter == b->counter;
}

/* Opens buf[0..len) in calls of at most `max` frames, the first read ending at `cut`; `in`
 * ends with the counts of what was skipped, *need with what the last call said was lacking. */
static size_t open_all(oc_gmac *g, const uint8_t *buf, size_t len, size_t cut, size_t max,
                       oc_frame *out, int *fault, size_t *consumed, oc_stream_in *in,
                       size_t *need) {
    *in = (oc_stream_in){.job = 7, .comm = 8, .peer = PEER};
    size_t n = 0, pos = 0, end = cut;
    *fault = 0;
    for (;;) {
        size_t used;
        size_t got = oc_stream_open(in, g, buf + pos, end - pos, out + n, max, &used, need,
                                    fault);
        if (got > max || used > end - pos) fail("more opened than asked or read");
        for (size_t i = 0; i < got; i++) out[n + i].payload += pos;
        n += got;
        pos += used;
        if (*need && !*fault) { /* what the next frame lacks, from its own header */
            size_t left = end - pos;
            oc_header h;
            size_t whole = left < OC_HEADER_BYTES || oc_header_parse(buf + pos, left, &h)
                               ? OC_HEADER_BYTES : h.length + (size_t)OC_OVERHEAD_BYTES;
            if (left + *need != whole) fail("a partial frame said to lack what it does not");
        }
        if (*fault) break;
        if (got == max) continue;
        if (end == len) break;
        end = len; /* the second read */
    }
    *consumed = pos;
    return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static oc_gmac g;
    static int ready;
    if (!ready) {
        if (oc_gmac_init(&g, KEY, 0)) fail("key");
        ready = 1;
    }
    script s = {data, size};
    oc_sealer peer = {.job = 7, .comm = 8, .src = PEER};
    if (oc_gmac_init(&peer.gmac, KEY, 1)) fail("key");
    static uint8_t buf[CAP], intact[CAP];
    uint8_t payload[600];
    size_t len = 0;
    /* Without raw bytes every frame is where it was sealed, so what must open is known: the
     * intact frames of this communicator whose counter is above every one opened before. */
    int raw = 0;
    size_t opens = 0;
    uint64_t foreign = 0, bad_mac = 0, replayed = 0, top = 0;
    int any = 0;
    memset(intact, 0, sizeof intact);
    while (s.left && len < CAP) {
        unsigned what = take(&s, 1);
        if (what % 8 == 7) { /* raw bytes */
            raw = 1;
            for (unsigned n = take(&s, 1) % 80; n-- && len < CAP;)
                buf[len++] = (uint8_t)take(&s, 1);
            continue;
        }
        unsigned plen = take(&s, 2) % sizeof payload;
        for (unsigned i = 0; i < plen; i++) payload[i] = (uint8_t)(i * 31 + what);
        peer.comm = what % 8 == 6 ? 9 : 8;
        if (what % 8 == 5 && peer.counter > 3) peer.counter -= 3;
        size_t n = oc_seal_into(&peer, buf + len, CAP - len, KINDS[take(&s, 1) % sizeof KINDS],
                                take(&s, 2), (uint16_t)take(&s, 2), take(&s, 2), payload, plen);
        if (n == 0) break;
        uint64_t counter = peer.counter;
        if (peer.comm != 8) {
            foreign++;
        } else if (what % 8 == 4) { /* a bit flipped past the header: only the tag catches it */
            buf[len + OC_HEADER_BYTES + take(&s, 2) % (n - OC_HEADER_BYTES)] ^=
                (uint8_t)(1u << (what >> 5));
            bad_mac++;
        } else if (any && counter <= top) {
            replayed++;
        } else {
            intact[len] = 1;
            opens++;
            top = counter;
            any = 1;
        }
        len += n;
    }
    oc_gmac_free(&peer.gmac);
    size_t cut = size ? data[0] * len / 255 : len, max = size > 1 ? 1 + data[1] % 4 : 1;
    static oc_frame whole[MAX_FRAMES], pieces[MAX_FRAMES];
    int fault_whole, fault_pieces;
    size_t used_whole, used_pieces, need_whole, need_pieces;
    oc_stream_in in_whole, in_pieces;
    size_t n = open_all(&g, buf, len, len, MAX_FRAMES, whole, &fault_whole, &used_whole,
                        &in_whole, &need_whole);
    if (!raw && (n != opens || fault_whole || used_whole != len ||
                 need_whole != OC_HEADER_BYTES || in_whole.foreign != foreign ||
                 in_whole.bad_mac != bad_mac || in_whole.replayed != replayed))
        fail("well-framed frames opened or skipped otherwise than sealed");
    uint64_t last = 0;
    for (size_t i = 0; i < n; i++) {
        size_t at = whole[i].payload - OC_HEADER_BYTES;
        if (whole[i].payload < OC_HEADER_BYTES || !intact[at] || whole[i].h.src != PEER ||
            at + whole[i].h.length + OC_OVERHEAD_BYTES > used_whole)
            fail("a frame opened that was not sealed intact there");
        if (i && whole[i].h.counter <= last) fail("a counter not above the one before");
        last = whole[i].h.counter;
    }
    size_t m = open_all(&g, buf, len, cut, max, pieces, &fault_pieces, &used_pieces,
                        &in_pieces, &need_pieces);
    if (m != n || fault_pieces != fault_whole || used_pieces != used_whole ||
        need_pieces != need_whole || in_pieces.next_counter != in_whole.next_counter ||
        in_pieces.foreign != in_whole.foreign || in_pieces.bad_mac != in_whole.bad_mac ||
        in_pieces.replayed != in_whole.replayed)
        fail("two reads open otherwise than one");
    for (size_t i = 0; i < n; i++)
        if (!same_header(&pieces[i].h, &whole[i].h) || pieces[i].payload != whole[i].payload)
            fail("two reads open another frame than one");
    return 0;
}
