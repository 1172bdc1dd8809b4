/* The native core's unit tests, one section per part; built and run by tests/test_native.py,
 * under AddressSanitizer and UndefinedBehaviorSanitizer. Each check prints what failed; the
 * last line counts them as "N passed, N failed". */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>

#include "aggregator/aggregator.h"
#include "evp_gmac.h"
#include "rank/budget.h"
#include "common/clock.h"
#include "common/ghash.h"
#include "common/numbering.h"
#include "rank/plane.h"
#include "rank/port.h"
#include "aggregator/service.h"
#include "aggregator/shards.h"
#include "rank/stream.h"
#include "common/sums.h"
#include "common/udp.h"
#include "common/wire.h"

/* Checks may run on several threads at once (main's "threads"). */
static _Atomic int passed, failed;
#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        if (cond) {                                                                           \
            passed++;                                                                         \
        } else {                                                                              \
            failed++;                                                                         \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                                       \
            printf(__VA_ARGS__);                                                              \
            printf("\n");                                                                     \
        }                                                                                     \
    } while (0)

static _Thread_local uint64_t rng = 88172645463325252ull;
static uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static const uint8_t KEY[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

/* -- wire ---------------------------------------------------------------------------------- */

static void test_header(void) {
    oc_header h = {OC_CONTRIB, 7, 9, 11, 3, OC_AGGREGATOR, 0xdeadbeef, 1234, 0x0102030405060708ull};
    uint8_t b[OC_HEADER_BYTES];
    oc_header_write(b, &h);
    CHECK(b[0] == 'O' && b[1] == 'C' && b[2] == OC_VERSION && b[3] == OC_CONTRIB, "magic");
    oc_header back;
    CHECK(oc_header_parse(b, sizeof b, &back) == 0 && back.kind == h.kind && back.job == h.job &&
          back.comm == h.comm && back.seq == h.seq && back.src == h.src && back.dst == h.dst &&
          back.chunk == h.chunk && back.length == h.length && back.counter == h.counter,
          "a header reads back as written");
    CHECK(oc_header_parse(b, sizeof b - 1, &back) == -1, "a short header is malformed");
    uint8_t bad[OC_HEADER_BYTES];
    memcpy(bad, b, sizeof b);
    bad[0] = 'X';
    CHECK(oc_header_parse(bad, sizeof bad, &back) == -1, "bad magic");
    memcpy(bad, b, sizeof b);
    bad[2] = OC_VERSION - 1;
    CHECK(oc_header_parse(bad, sizeof bad, &back) == -1, "the version before");
    bad[2] = OC_VERSION + 1;
    CHECK(oc_header_parse(bad, sizeof bad, &back) == -1, "the version after");
    memcpy(bad, b, sizeof b);
    bad[3] = 99;
    CHECK(oc_header_parse(bad, sizeof bad, &back) == -1, "an unknown kind");
    h.length = OC_MAX_PAYLOAD + 1;
    oc_header_write(bad, &h);
    CHECK(oc_header_parse(bad, sizeof bad, &back) == -1, "an oversized payload");
}

static void test_seal_and_open(void) {
    oc_sealer s = {.job = 5, .comm = 6, .src = 2, .counter = 41};
    oc_gmac opener;
    CHECK(oc_gmac_init(&s.gmac, KEY, 1) == 0 && oc_gmac_init(&opener, KEY, 0) == 0, "keys");
    uint8_t payload[300], msg[400];
    for (size_t i = 0; i < sizeof payload; i++) payload[i] = (uint8_t)next();
    CHECK(oc_seal_into(&s, msg, OC_OVERHEAD_BYTES + 299, OC_CONTRIB, 1, OC_AGGREGATOR, 3,
                       payload, sizeof payload) == 0 && s.counter == 41,
          "a message that does not fit is not sealed and spends no counter");
    size_t n = oc_seal_into(&s, msg, sizeof msg, OC_CONTRIB, 1, OC_AGGREGATOR, 3, payload,
                            sizeof payload);
    CHECK(n == OC_OVERHEAD_BYTES + sizeof payload && s.counter == 42, "sealed: %zu", n);
    oc_header h;
    CHECK(oc_header_parse(msg, n, &h) == 0 && h.counter == 42 && h.length == sizeof payload &&
          h.src == 2 && h.job == 5 && h.comm == 6, "its header");
    CHECK(oc_gmac_check(&opener, 2, 42, msg, n - OC_TAG_BYTES, msg + n - OC_TAG_BYTES),
          "it opens");
    CHECK(!oc_gmac_check(&opener, 2, 43, msg, n - OC_TAG_BYTES, msg + n - OC_TAG_BYTES),
          "not under another counter");
    CHECK(!oc_gmac_check(&opener, 3, 42, msg, n - OC_TAG_BYTES, msg + n - OC_TAG_BYTES),
          "not from another sender");
    int every_flip_caught = 1;
    for (size_t bit = 0; bit < n * 8; bit += 7) {
        msg[bit / 8] ^= (uint8_t)(1 << bit % 8);
        if (oc_gmac_check(&opener, 2, 42, msg, n - OC_TAG_BYTES, msg + n - OC_TAG_BYTES))
            every_flip_caught = 0;
        msg[bit / 8] ^= (uint8_t)(1 << bit % 8);
    }
    CHECK(every_flip_caught, "a flipped bit anywhere in header, payload or tag fails the tag");
    oc_gmac other;
    uint8_t key2[16];
    memcpy(key2, KEY, 16);
    key2[0] ^= 1;
    CHECK(oc_gmac_init(&other, key2, 0) == 0, "key");
    CHECK(!oc_gmac_check(&other, 2, 42, msg, n - OC_TAG_BYTES, msg + n - OC_TAG_BYTES),
          "not under another key");
    CHECK(!oc_gmac_check(&s.gmac, 2, 42, msg, n - OC_TAG_BYTES, msg + n - OC_TAG_BYTES),
          "a sealing context never opens");
    oc_gmac_free(&other);
    oc_gmac_free(&opener);
    oc_gmac_free(&s.gmac);
}

/* ghash.h's tag is OpenSSL's for every length up to a few strides, for random lengths up to a
 * jumbo datagram's, cut anywhere into three pieces; and a message sealed on one path opens on
 * the other (OVERCAST_GMAC=openssl chooses EVP when a key is set). */
static void test_fast_gmac(void) {
    if (!oc_fast_gmac_usable()) {
        printf("skipped: the fast GMAC (no AES-NI and VPCLMULQDQ here)\n");
        return;
    }
    static oc_fast_gmac k;
    static uint8_t data[OC_MAX_DATAGRAM];
    int agree = 1;
    for (int t = 0; t < 2000; t++) {
        uint8_t key[16], iv[12], want[16], got[16];
        for (int i = 0; i < 16; i++) key[i] = (uint8_t)next();
        for (int i = 0; i < 12; i++) iv[i] = (uint8_t)next();
        size_t len = t < 600 ? (size_t)t : next() % sizeof data;
        for (size_t i = 0; i < len; i++) data[i] = (uint8_t)next();
        size_t a = len ? next() % (len + 1) : 0, b = a + (len > a ? next() % (len - a + 1) : 0);
        const uint8_t *pieces[3] = {data, data + a, data + b};
        size_t lens[3] = {a, b - a, len - b};
        oc_fast_gmac_init(&k, key);
        oc_fast_gmac_tag(&k, iv, pieces, lens, 3, got);
        evp_gmac(key, iv, data, len, want);
        if (memcmp(want, got, 16)) {
            if (agree) printf("  %zu bytes cut at %zu and %zu\n", len, a, b);
            agree = 0;
        }
    }
    CHECK(agree, "the fast GMAC's tags are OpenSSL's");
    oc_sealer fast = {.job = 1, .comm = 2, .src = 3};
    oc_gmac fast_opener, evp_opener;
    oc_sealer evp = {.job = 1, .comm = 2, .src = 3};
    CHECK(oc_gmac_init(&fast.gmac, KEY, 1) == 0 && oc_gmac_init(&fast_opener, KEY, 0) == 0 &&
          fast.gmac.fast && fast_opener.fast, "keys on the fast path");
    setenv("OVERCAST_GMAC", "openssl", 1);
    CHECK(oc_gmac_init(&evp.gmac, KEY, 1) == 0 && oc_gmac_init(&evp_opener, KEY, 0) == 0 &&
          evp.gmac.ctx && !evp.gmac.fast && evp_opener.ctx, "keys on OpenSSL's");
    unsetenv("OVERCAST_GMAC");
    uint8_t msg[2][OC_OVERHEAD_BYTES + 1000];
    for (size_t len = 0; len <= 1000; len += 37) {
        size_t n = oc_seal_into(&fast, msg[0], sizeof msg[0], OC_CONTRIB, 1, 4, 5, data, len);
        size_t m = oc_seal_into(&evp, msg[1], sizeof msg[1], OC_CONTRIB, 1, 4, 5, data, len);
        int same = n == m && n && memcmp(msg[0], msg[1], n) == 0 &&
                   oc_gmac_check(&evp_opener, 3, fast.counter, msg[0], n - OC_TAG_BYTES,
                                 msg[0] + n - OC_TAG_BYTES) &&
                   oc_gmac_check(&fast_opener, 3, evp.counter, msg[1], m - OC_TAG_BYTES,
                                 msg[1] + m - OC_TAG_BYTES);
        msg[0][OC_HEADER_BYTES / 2] ^= 1;
        same = same && !oc_gmac_check(&fast_opener, 3, fast.counter, msg[0], n - OC_TAG_BYTES,
                                      msg[0] + n - OC_TAG_BYTES);
        CHECK(same, "%zu bytes sealed the same on both paths, each opening the other's", len);
    }
    oc_gmac_free(&fast.gmac);
    oc_gmac_free(&fast_opener);
    oc_gmac_free(&evp.gmac);
    oc_gmac_free(&evp_opener);
}

/* A payload sealed where it lies: the header and tag are those of the same message sealed whole,
 * for a payload in one part or two. */
static void test_seal_detached(void) {
    oc_sealer whole = {.job = 5, .comm = 6, .src = 2, .counter = 7};
    oc_sealer apart = whole;
    CHECK(oc_gmac_init(&whole.gmac, KEY, 1) == 0 && oc_gmac_init(&apart.gmac, KEY, 1) == 0,
          "keys");
    uint8_t payload[1000], msg[1100], out[OC_OVERHEAD_BYTES];
    for (size_t i = 0; i < sizeof payload; i++) payload[i] = (uint8_t)next();
    for (size_t split = 0; split <= sizeof payload; split += 250) {
        size_t n = oc_seal_parts(&whole, msg, sizeof msg, OC_RING_DATA, 3, 1, 9, payload, split,
                                 payload + split, sizeof payload - split);
        CHECK(oc_seal_detached(&apart, out, OC_RING_DATA, 3, 1, 9, payload, split,
                               payload + split, sizeof payload - split) == 0,
              "sealed apart at %zu", split);
        CHECK(n == OC_OVERHEAD_BYTES + sizeof payload &&
                  memcmp(out, msg, OC_HEADER_BYTES) == 0 &&
                  memcmp(out + OC_HEADER_BYTES, msg + n - OC_TAG_BYTES, OC_TAG_BYTES) == 0 &&
                  apart.counter == whole.counter,
              "the same header, tag and counter as sealed whole (split at %zu)", split);
    }
    uint64_t spent = apart.counter;
    CHECK(oc_seal_detached(&apart, out, OC_RING_DATA, 3, 1, 9, payload, OC_MAX_PAYLOAD,
                           payload, 1) == -1 && apart.counter == spent,
          "a payload over the largest is refused and spends no counter");
    /* the last counter under a key is UINT64_MAX: after it, nothing more is sealed */
    whole.counter = apart.counter = UINT64_MAX - 1;
    CHECK(oc_seal_into(&whole, msg, sizeof msg, OC_FIN, 1, 1, 0, NULL, 0) == OC_OVERHEAD_BYTES &&
              oc_seal_into(&whole, msg, sizeof msg, OC_FIN, 2, 1, 0, NULL, 0) == 0 &&
              whole.counter == UINT64_MAX,
          "a spent key seals nothing more whole");
    CHECK(oc_seal_detached(&apart, out, OC_FIN, 1, 1, 0, NULL, 0, NULL, 0) == 0 &&
              oc_seal_detached(&apart, out, OC_FIN, 2, 1, 0, NULL, 0, NULL, 0) == -1 &&
              apart.counter == UINT64_MAX,
          "nor detached");
    oc_gmac_free(&whole.gmac);
    oc_gmac_free(&apart.gmac);
}

/* A stream's read opened in place: whole frames in order, the partial one left with what it
 * lacks, skipped frames counted by why, a header that ends the stream named, `max` honoured. */
static void test_stream_open(void) {
    oc_sealer peer = {.job = 5, .comm = 6, .src = 3, .counter = 10};
    oc_sealer other = {.job = 5, .comm = 7, .src = 3, .counter = 50};
    oc_gmac g;
    CHECK(oc_gmac_init(&peer.gmac, KEY, 1) == 0 && oc_gmac_init(&other.gmac, KEY, 1) == 0 &&
              oc_gmac_init(&g, KEY, 0) == 0,
          "keys");
    uint8_t buf[1024], payload[100];
    for (size_t i = 0; i < sizeof payload; i++) payload[i] = (uint8_t)next();
    size_t at = 0, ends[6];
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_FIN, 1, 0, 0, NULL, 0);
    ends[0] = at;
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_DESCRIBE, 2, 0, 4, payload, 100);
    ends[1] = at;
    at += oc_seal_into(&other, buf + at, sizeof buf - at, OC_FIN, 3, 0, 0, NULL, 0);  /* foreign */
    ends[2] = at;
    peer.counter = 5;                                                          /* replayed */
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_FIN, 4, 0, 0, NULL, 0);
    ends[3] = at;
    peer.counter = 12;
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_MCAST_END, 5, 0, 0, payload, 7);
    buf[at - 1] ^= 1;                                                          /* bad tag */
    ends[4] = at;
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_FIN, 6, 0, 0, payload, 20);
    ends[5] = at;
    oc_frame frames[8];
    size_t used, need;
    int fault;
    oc_stream_in in = {.job = 5, .comm = 6, .peer = 3};
    size_t n = oc_stream_open(&in, &g, buf, ends[5] - 9, frames, 8, &used, &need, &fault);
    CHECK(n == 2 && used == ends[4] && need == 9 && fault == 0,
          "two authentic frames, three skipped, the last lacking 9 bytes: %zu %zu %zu %d", n,
          used, need, fault);
    CHECK(frames[0].h.kind == OC_FIN && frames[0].h.seq == 1 &&
              frames[1].h.counter == frames[0].h.counter + 1 &&
              frames[0].payload == OC_HEADER_BYTES && frames[1].h.seq == 2 &&
              frames[1].h.chunk == 4 && frames[1].h.length == 100 &&
              frames[1].payload == ends[0] + OC_HEADER_BYTES &&
              memcmp(buf + frames[1].payload, payload, 100) == 0,
          "each frame's header and payload offset");
    CHECK(in.foreign == 1 && in.replayed == 1 && in.bad_mac == 1 &&
              in.next_counter == frames[1].h.counter + 1,
          "skipped by why: %llu foreign, %llu replayed, %llu bad tag; next counter %llu",
          (unsigned long long)in.foreign, (unsigned long long)in.replayed,
          (unsigned long long)in.bad_mac, (unsigned long long)in.next_counter);
    n = oc_stream_open(&in, &g, buf + used, ends[5] - used, frames, 8, &used, &need, &fault);
    CHECK(n == 1 && frames[0].h.seq == 6 && need == OC_HEADER_BYTES && fault == 0,
          "the rest, once whole; then a header's worth lacking");
    n = oc_stream_open(&in, &g, buf, 10, frames, 8, &used, &need, &fault);
    CHECK(n == 0 && used == 0 && need == OC_HEADER_BYTES - 10, "a partial header");
    in = (oc_stream_in){.job = 5, .comm = 6, .peer = 3};
    n = oc_stream_open(&in, &g, buf, ends[5], frames, 1, &used, &need, &fault);
    CHECK(n == 1 && used == ends[0] && need == 0 && fault == 0, "stops at max");
    in = (oc_stream_in){.job = 5, .comm = 6, .peer = 2};
    n = oc_stream_open(&in, &g, buf, ends[5], frames, 8, &used, &need, &fault);
    CHECK(n == 0 && used == 0 && fault == OC_MISFIT_WRONG_SENDER, "another sender ends it");
    in = (oc_stream_in){.job = 5, .comm = 6, .peer = 3};
    buf[ends[0] + 3] = 99;                                                     /* unknown kind */
    n = oc_stream_open(&in, &g, buf, ends[5], frames, 8, &used, &need, &fault);
    CHECK(n == 1 && used == ends[0] && fault == OC_MISFIT_MALFORMED,
          "a header that is no frame ends it after the frames before");
    /* A counter equal to the last accepted is a replay; UINT64_MAX would leave none above. */
    at = 0;
    peer.counter = 20;
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_FIN, 1, 0, 0, NULL, 0);
    peer.counter = 20;
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_FIN, 2, 0, 0, NULL, 0);
    peer.counter = UINT64_MAX - 1;
    at += oc_seal_into(&peer, buf + at, sizeof buf - at, OC_FIN, 3, 0, 0, NULL, 0);
    in = (oc_stream_in){.job = 5, .comm = 6, .peer = 3};
    n = oc_stream_open(&in, &g, buf, at, frames, 8, &used, &need, &fault);
    CHECK(n == 1 && frames[0].h.seq == 1 && in.replayed == 2 && in.next_counter == 22 &&
              used == at,
          "an equal counter and UINT64_MAX are replays: %zu opened, %llu replayed", n,
          (unsigned long long)in.replayed);
    oc_gmac_free(&peer.gmac);
    oc_gmac_free(&other.gmac);
    oc_gmac_free(&g);
}

/* The window against its definition: a set of what was taken and the highest taken. */
static void test_replay_window(void) {
    static const uint32_t widths[] = {0, 1, 63, 64, 65, 1000};
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        uint32_t width = widths[w];
        oc_replay win;
        CHECK(oc_replay_init(&win, width) == 0, "window");
        enum { SPAN = 5000 };
        static uint8_t taken[SPAN];
        memset(taken, 0, sizeof taken);
        int64_t top = -1;
        int agree = 1;
        for (int i = 0; i < 20000; i++) {
            int64_t c;
            uint64_t r = next();
            if (top < 0 || r % 4 == 0) c = (int64_t)(r >> 8) % SPAN;
            else c = top - (int64_t)((r >> 8) % (width + 80)) + (int64_t)(r >> 40) % 40;
            if (c < 0) c = 0;
            if (c >= SPAN) c = SPAN - 1;
            int expect = c > top || (top - c < (int64_t)width && !taken[c]);
            int got = oc_replay_accept(&win, (uint64_t)c);
            if (got != expect) agree = 0;
            if (expect) {
                taken[c] = 1;
                if (c > top) top = c;
            }
        }
        CHECK(agree, "the window of width %u keeps to its definition", width);
        oc_replay_free(&win);
    }
    oc_replay big;
    oc_replay_init(&big, 1u << 14);
    CHECK(oc_replay_accept(&big, 1) && oc_replay_accept(&big, UINT64_MAX - 1) &&
          !oc_replay_accept(&big, 1) && oc_replay_accept(&big, UINT64_MAX - 2) &&
          !oc_replay_accept(&big, UINT64_MAX - 2) && oc_replay_accept(&big, UINT64_MAX),
          "counters near the top of 64 bits");
    oc_replay_free(&big);
}

/* -- sums ---------------------------------------------------------------------------------- */

static int is_nan16(uint16_t h, int brain) {
    return brain ? (h & 0x7fff) > 0x7f80 : (h & 0x7fff) > 0x7c00;
}

/* -- numbering: each chunk once, a group of one owner at a time, every block in turn -------- */
static void test_numbering(void) {
    static const uint64_t cases[][3] = {{2, 1, 1}, {3, 7, 1}, {8, 19, 4}, {5, 8, 4},
                                        {4, 3, 4}, {7, 30, 7}, {1, 5, 2}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint64_t world = cases[i][0], k = cases[i][1], group = cases[i][2], n = world * k;
        uint32_t *block = calloc(n, sizeof *block);
        uint64_t *place = calloc(n, sizeof *place), *seen = calloc(n, sizeof *seen);
        uint64_t *next_c = calloc(world, sizeof *next_c);
        int once = 1, one_owner = 1, in_turn = 1, spans = 1, simple = 1;
        for (uint64_t g = 0; g < n; g++) {
            block[g] = oc_chunk_place(g, world, k, group, &place[g]);
            if (block[g] >= world || place[g] >= k || seen[block[g] * k + place[g]]++) once = 0;
            if (place[g] != next_c[block[g]]++) in_turn = 0;  /* a block's chunks in order */
            if (group == 1 && (block[g] != g % world || place[g] != g / world)) simple = 0;
        }
        for (uint64_t t = 0; t + group <= world * (k - k % group); t += group)
            for (uint64_t j = 1; j < group; j++) one_owner &= block[t + j] == block[t];
        for (uint64_t g = 0; g < n; g++) {
            uint32_t first, end, owner = oc_owner_span(g, world, k, group, &first, &end);
            int ok = owner == block[g] && first <= g && g < end && end <= n;
            for (uint32_t h = first; ok && h < end; h++) ok = block[h] == owner;
            /* the span is g's whole group: with one rank, groups of one owner meet */
            ok &= world == 1 || first == 0 || block[first - 1] != owner;
            ok &= world == 1 || end == n || block[end] != owner;
            ok &= end - first == group || (end - first == k % group && place[g] >= k - k % group);
            spans &= ok;
        }
        CHECK(once && one_owner && in_turn && spans && simple,
              "numbering P=%llu k=%llu group=%llu: each chunk once %d, a group one owner %d, "
              "blocks in turn %d, owner spans %d, group of one as g mod P %d",
              (unsigned long long)world, (unsigned long long)k, (unsigned long long)group, once,
              one_owner, in_turn, spans, simple);
        free(block), free(place), free(seen), free(next_c);
    }
}

/* Striping over endpoints: each chunk on one endpoint, numbered there in the order of g, and
 * its number there leads back to it. */
static void test_striping(void) {
    static const uint64_t cases[][3] = {{40, 1, 1}, {40, 1, 3}, {100, 4, 2}, {97, 8, 5},
                                        {7, 16, 3}, {1000, 255, 4}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint64_t total = cases[i][0], group = cases[i][1], stripes = cases[i][2];
        uint64_t next[8] = {0};
        int ok = 1;
        for (uint64_t g = 0; g < total; g++) {
            uint32_t e = oc_stripe_of_chunk(g, group, stripes);
            uint64_t h = oc_stripe_local(g, group, stripes);
            ok &= e < stripes && h == next[e]++ && oc_stripe_global(h, group, stripes, e) == g;
            ok &= oc_stripe_count(g, group, stripes, e) == h; /* those below g: h of them */
        }
        for (uint32_t e = 0; e < stripes; e++) ok &= oc_stripe_count(total, group, stripes, e) == next[e];
        /* by endpoint: collective seq's lane l is endpoint (l + seq) mod stripes */
        for (uint32_t seq = 0; seq < 3; seq++)
            for (uint64_t g = 0; g < total; g++) {
                uint32_t e = oc_endpoint_of_chunk(g, group, (uint32_t)stripes, seq);
                uint64_t h = oc_endpoint_count(g, group, (uint32_t)stripes, e, seq);
                ok &= e == (oc_stripe_of_chunk(g, group, stripes) + seq) % stripes &&
                      h == oc_stripe_local(g, group, stripes) &&
                      oc_endpoint_global(h, group, (uint32_t)stripes, e, seq) == g;
            }
        CHECK(ok, "striping %llu chunks in runs of %llu over %llu endpoints",
              (unsigned long long)total, (unsigned long long)group, (unsigned long long)stripes);
    }
}

static void test_conversions(void) {
    int half_ok = 1, brain_ok = 1;
    for (uint32_t h = 0; h < 65536; h++) {
        if (!is_nan16((uint16_t)h, 0) && oc_float_to_half(oc_half_to_float((uint16_t)h)) != h)
            half_ok = 0;
        if (!is_nan16((uint16_t)h, 1) && oc_float_to_bfloat(oc_bfloat_to_float((uint16_t)h)) != h)
            brain_ok = 0;
    }
    CHECK(half_ok, "every float16 goes to float32 and back unchanged");
    CHECK(brain_ok, "every bfloat16 goes to float32 and back unchanged");
    /* rounding: the nearest of the two neighbours, ties to even */
    int nearest_half = 1, nearest_brain = 1;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)next();
        float f;
        memcpy(&f, &u, 4);
        if (isnan(f)) continue;
        for (int brain = 0; brain < 2; brain++) {
            uint16_t h = brain ? oc_float_to_bfloat(f) : oc_float_to_half(f);
            double got = brain ? oc_bfloat_to_float(h) : oc_half_to_float(h);
            int ok = 1;
            for (int d = -1; d <= 1; d += 2) {
                uint16_t n = (uint16_t)(h + d);
                if (is_nan16(n, brain) || (n & 0x7fff) == 0x7fff) continue;
                if (((n ^ h) & 0x8000) && (h & 0x7fff)) continue; /* across zero only from 0 */
                double other = brain ? oc_bfloat_to_float(n) : oc_half_to_float(n);
                if (isinf(got) || isinf(other)) continue;
                double eg = fabs(got - f), eo = fabs(other - f);
                if (eo < eg || (eo == eg && (h & 1))) ok = 0;
            }
            if (!ok) {
                if (brain) nearest_brain = 0;
                else nearest_half = 0;
            }
        }
    }
    CHECK(nearest_half, "float32 rounds to the nearest float16, ties to even");
    CHECK(nearest_brain, "float32 rounds to the nearest bfloat16, ties to even");
    CHECK(oc_float_to_half(65520.0f) == 0x7c00 && oc_float_to_half(65519.0f) == 0x7bff,
          "float16 overflows to infinity at 65520");
    CHECK(oc_float_to_half(0x1p-25f) == 0 && oc_float_to_half(0x1.000002p-25f) == 1,
          "the smallest float16 subnormal, rounded");
}

/* Every dtype against a sum taken element by element in rank order, the owner skipped. */
static void test_sums(void) {
    enum { ROWS = 7, ELEMS = 1031 };
    static _Alignas(16) uint8_t rows[ROWS][ELEMS * 8], out[ELEMS * 8], out_late[ELEMS * 8],
        moved[ELEMS * 8 + 1];
    for (unsigned code = 0; code < OC_DTYPES; code++) {
        size_t size = oc_dtype_size(code);
        for (unsigned skip = 0; skip < ROWS; skip += 3) {
            for (int r = 0; r < ROWS; r++)
                for (size_t i = 0; i < ELEMS * size; i++) rows[r][i] = (uint8_t)next();
            if (code == OC_FLOAT32 || code == OC_FLOAT64 || code == OC_FLOAT16 ||
                code == OC_BFLOAT16) /* finite values of a sensible scale */
                for (int r = 0; r < ROWS; r++)
                    for (size_t i = 0; i < ELEMS; i++) {
                        float v = (float)((int64_t)(next() % 20001) - 10000) / 1000.0f;
                        if (code == OC_FLOAT32) memcpy(rows[r] + 4 * i, &v, 4);
                        if (code == OC_FLOAT64) { double d = v; memcpy(rows[r] + 8 * i, &d, 8); }
                        if (code == OC_FLOAT16) { uint16_t h = oc_float_to_half(v); memcpy(rows[r] + 2 * i, &h, 2); }
                        if (code == OC_BFLOAT16) { uint16_t b = oc_float_to_bfloat(v); memcpy(rows[r] + 2 * i, &b, 2); }
                    }
            oc_sum_rows(code, out, rows[0], sizeof rows[0], ROWS, skip, ELEMS, ROWS, NULL);
            /* the same with one row read from elsewhere, one byte off any alignment */
            unsigned late = (skip + 1) % ROWS;
            memcpy(moved + 1, rows[late], ELEMS * size);
            memset(rows[late], 0xA5, ELEMS * size);
            oc_sum_rows(code, out_late, rows[0], sizeof rows[0], ROWS, skip, ELEMS, late, moved + 1);
            memcpy(rows[late], moved + 1, ELEMS * size);
            CHECK(memcmp(out, out_late, ELEMS * size) == 0,
                  "dtype %u, owner %u: row %u read from a misaligned datagram sums the same", code,
                  skip, late);
            int same = 1;
            for (size_t i = 0; i < ELEMS; i++) {
                uint64_t u = 0;
                float f = 0;
                double d = 0;
                int first = 1;
                for (unsigned r = 0; r < ROWS; r++) {
                    if (r == skip) continue;
                    const uint8_t *p = rows[r] + i * size;
                    uint64_t x = 0;
                    memcpy(&x, p, size);
                    u = first ? x : u + x;
                    if (code == OC_FLOAT32) { float v; memcpy(&v, p, 4); f = first ? v : f + v; }
                    if (code == OC_FLOAT64) { double v; memcpy(&v, p, 8); d = first ? v : d + v; }
                    if (code == OC_FLOAT16 || code == OC_BFLOAT16) {
                        uint16_t h;
                        memcpy(&h, p, 2);
                        float v = code == OC_FLOAT16 ? oc_half_to_float(h) : oc_bfloat_to_float(h);
                        f = first ? v : f + v;
                    }
                    first = 0;
                }
                uint64_t want = u, got = 0;
                if (code == OC_FLOAT32) memcpy(&want, &f, 4);
                if (code == OC_FLOAT64) memcpy(&want, &d, 8);
                if (code == OC_FLOAT16) want = oc_float_to_half(f);
                if (code == OC_BFLOAT16) want = oc_float_to_bfloat(f);
                if (size < 8) want &= (1ull << (8 * size)) - 1;
                memcpy(&got, out + i * size, size);
                if (got != want) same = 0;
            }
            CHECK(same, "dtype %u, owner %u: the same bits as a sum in rank order", code, skip);
        }
    }
    /* the owner's own row may be the output (the engine sums into it) */
    oc_sum_rows(OC_INT32, rows[2], rows[0], sizeof rows[0], ROWS, 2, ELEMS, ROWS, NULL);
    oc_sum_rows(OC_INT32, out, rows[0], sizeof rows[0], ROWS, 2, ELEMS, ROWS, NULL);
    CHECK(memcmp(out, rows[2], ELEMS * 4) == 0, "summed into the skipped row");
}

/* -- the aggregator, on sealed datagrams --------------------------------------------------- */

enum { WORLD = 3, K = 5, ELEMS_PER_CHUNK = 4 };

typedef struct {
    uint8_t data[65536];
    size_t len, segment;
    uint16_t dst;
    int count;
} captured;

static void capture(void *ctx, int handle, uint16_t dst, const uint8_t *data, size_t len,
                    size_t segment) {
    captured *c = ctx; /* keeps the first batch, counts them all */
    (void)handle;
    if (c->count++ || len > sizeof c->data) return;
    memcpy(c->data, data, len);
    c->len = len;
    c->segment = segment;
    c->dst = dst;
}

static size_t contribution(oc_sealer *s, uint8_t *buf, uint32_t g, int32_t value) {
    uint8_t payload[12 + 4 * ELEMS_PER_CHUNK] = {OC_INT32, 1, WORLD, 0, WORLD * K, 0, 0, 0, 0, 0, 1, 0};
    for (int i = 0; i < ELEMS_PER_CHUNK; i++) memcpy(payload + 12 + 4 * i, &value, 4);
    return oc_seal_into(s, buf, 512, OC_CONTRIB, 0, OC_AGGREGATOR, g, payload, sizeof payload);
}

static void test_aggregator(void) {
    oc_agg *a = oc_agg_new(64);
    uint32_t granted;
    int h = oc_agg_register(a, 1, 2, WORLD, 0, 16, OC_MAX_DATAGRAM, KEY, 1000, &granted);
    CHECK(h >= 0 && granted == 16, "registered, %u slots: a window past every chunk", granted);
    oc_agg_set_address(a, h, 0, 0x0100007f, 1000, 0);
    oc_sealer ranks[WORLD];
    oc_gmac opener;
    oc_gmac_init(&opener, KEY, 0);
    for (int r = 0; r < WORLD; r++) {
        ranks[r] = (oc_sealer){.job = 1, .comm = 2, .src = (uint16_t)r};
        oc_gmac_init(&ranks[r].gmac, KEY, 1);
    }
    /* every rank contributes (rank + 1) * 10 + g to every chunk it does not own, as one batch
     * of back-to-back datagrams per rank */
    for (int r = 0; r < WORLD; r++) {
        uint8_t batch[WORLD * K * 512];
        size_t len = 0, segment = 0;
        for (uint32_t g = 0; g < WORLD * K; g++) {
            if (g % WORLD == (uint32_t)r) continue; /* group 1: chunk g is rank g % P's */
            size_t n = contribution(&ranks[r], batch + len, g, (r + 1) * 10 + (int32_t)g);
            segment = n;
            len += n;
        }
        oc_agg_feed(a, batch, len, segment, 0.0);
    }
    const uint64_t *stats = oc_agg_stats(a), *drops = oc_agg_drops(a);
    CHECK(stats[OC_STAT_contributions] == WORLD * K * (WORLD - 1), "contributions taken: %llu",
          (unsigned long long)stats[OC_STAT_contributions]);
    CHECK(stats[OC_STAT_results] == WORLD * K, "every chunk summed");
    uint64_t dropped = 0;
    for (int i = 0; i < OC_DROP_COUNT; i++) dropped += drops[i];
    CHECK(dropped == 0, "nothing dropped");
    /* the results, opened as a rank would */
    int results_right = 1, results = 0;
    for (size_t i = 0; i < oc_agg_outbox_count(a); i++) {
        const oc_out *o = oc_agg_outbox(a, i);
        if (o->kind != OC_RESULT) continue;
        results++;
        int32_t want = 0, got;
        for (int r = 0; r < WORLD; r++)
            if ((uint32_t)r != o->chunk % WORLD) want += (r + 1) * 10 + (int32_t)o->chunk;
        memcpy(&got, oc_agg_payload(a, o), 4);
        if (o->dst != o->chunk % WORLD || got != want || o->len != 4 * ELEMS_PER_CHUNK) results_right = 0;
    }
    CHECK(results == WORLD * K && results_right, "each result is its chunk's sum, to its owner");
    captured out = {0};
    oc_agg_flush(a, capture, &out);
    CHECK(oc_agg_outbox_count(a) == 0, "the flush empties the outbox");
    CHECK(out.count > 0 && out.dst == 2,
          "sealed batches reached the emitter, the first for rank 2 (ranks 0 and 1 came first)");
    oc_header first;
    CHECK(oc_header_parse(out.data, out.len, &first) == 0 && first.src == OC_AGGREGATOR &&
          first.counter == 1001, "sealed by the aggregator, its counter after 1000");
    /* each datagram of the first batch opens under the key */
    int opens = 1;
    for (size_t at = 0; at + OC_OVERHEAD_BYTES <= out.len;) {
        oc_header hh;
        if (oc_header_parse(out.data + at, out.len - at, &hh)) { opens = 0; break; }
        size_t n = OC_OVERHEAD_BYTES + hh.length;
        if (at + n > out.len || !oc_gmac_check(&opener, hh.src, hh.counter, out.data + at,
                                                n - OC_TAG_BYTES, out.data + at + n - OC_TAG_BYTES))
            opens = 0;
        at += n;
    }
    CHECK(opens, "every sealed datagram opens");
    /* a replayed batch is dropped, datagram by datagram */
    uint8_t again[512];
    ranks[1].counter--;
    size_t n = contribution(&ranks[1], again, 0, 1);
    oc_agg_feed(a, again, n, n, 0.0);
    CHECK(drops[OC_DROP_replayed] == 1, "a counter used twice is a replay");
    again[40] ^= 1;
    oc_agg_feed(a, again, n, n, 0.0);
    CHECK(drops[OC_DROP_bad_mac] == 1, "a changed byte fails the tag");
    CHECK(oc_agg_pool_bytes(a) > 0, "the pool lives while the reduction does");
    /* acknowledgements of every result finish the reduction and free its pool */
    for (int r = 0; r < WORLD; r++) {
        uint8_t acks[4 * K], msg[256];
        for (int c = 0; c < K; c++) {
            uint32_t g = (uint32_t)(c * WORLD + r);
            memcpy(acks + 4 * c, &g, 4);
        }
        size_t m = oc_seal_into(&ranks[r], msg, sizeof msg, OC_RESULT_ACK, 0, OC_AGGREGATOR, K,
                                acks, sizeof acks);
        oc_agg_feed(a, msg, m, m, 0.01);
    }
    CHECK(stats[OC_STAT_reductions] == 1 && oc_agg_pool_bytes(a) == 0,
          "acknowledged, the reduction is done and its pool freed");
    uint32_t seqs[4], released[4];
    CHECK(oc_agg_reductions(a, h, seqs, released, 4) == 0, "none left in flight");
    /* a reduction left in flight: unregistering frees it (LeakSanitizer checks the rest) */
    oc_sealer *r0 = &ranks[1];
    uint8_t one[512];
    r0->counter = 5000;
    uint8_t payload[12 + 16] = {OC_INT32, 1, WORLD, 0, WORLD * K, 0, 0, 0, 0, 0, 1, 0};
    size_t m = oc_seal_into(r0, one, sizeof one, OC_CONTRIB, 1, OC_AGGREGATOR, 0, payload, sizeof payload);
    oc_agg_feed(a, one, m, m, 0.02);
    CHECK(oc_agg_pool_bytes(a) > 0 && oc_agg_timer(a) >= 0, "a second reduction in flight");
    oc_agg_unregister(a, h);
    CHECK(oc_agg_pool_bytes(a) == 0, "unregistered mid-reduction, its pool is freed");
    oc_agg_feed(a, one, m, m, 0.03);
    CHECK(drops[OC_DROP_foreign] == 1, "its datagrams are foreign now");
    for (int r = 0; r < WORLD; r++) oc_gmac_free(&ranks[r].gmac);
    oc_gmac_free(&opener);
    oc_agg_free(a);
}

/* A CREDIT naming many chunks to send again is cut into datagrams no larger than the
 * communicator's contributions: a path of a small MTU takes nothing larger. */
static void test_credit_fits_the_path(void) {
    enum { ROW = 16, SLOTS = 64 };
    oc_agg *a = oc_agg_new(SLOTS);
    uint32_t granted;
    int h = oc_agg_register(a, 1, 2, WORLD, 0, SLOTS, ROW, KEY, 1000, &granted);
    oc_agg_set_address(a, h, 1, 0x0100007f, 1000, 0);
    oc_sealer rank = {.job = 1, .comm = 2, .src = 1};
    oc_gmac_init(&rank.gmac, KEY, 1);
    uint8_t probe[128], below[4] = {SLOTS, 0, 0, 0}; /* a reduction never started */
    size_t n = oc_seal_into(&rank, probe, sizeof probe, OC_CREDIT, 7, OC_AGGREGATOR, 0, below, 4);
    oc_agg_feed(a, probe, n, n, 0.0);
    size_t credits = 0, named = 0, widest = 0;
    for (size_t i = 0; i < oc_agg_outbox_count(a); i++) {
        const oc_out *o = oc_agg_outbox(a, i);
        if (o->kind != OC_CREDIT) continue;
        credits++;
        named += (o->len - 4) / 4;
        if (o->len > widest) widest = o->len;
    }
    CHECK(named == SLOTS && credits > 1 && widest <= ROW + 12,
          "%zu chunks named in %zu credits of at most %zu bytes (a contribution: %d)", named,
          credits, widest, ROW + 12);
    oc_gmac_free(&rank.gmac);
    oc_agg_free(a);
}

/* A second registration with another world replaces the first, freeing what it held. */
static void test_reregistration(void) {
    oc_agg *a = oc_agg_new(4);
    uint32_t granted;
    int h = oc_agg_register(a, 1, 1, 2, 0, 0, OC_MAX_DATAGRAM, NULL, 0, &granted);
    uint8_t payload[12 + 8] = {OC_INT64, 1, 2, 0, 4, 0, 0, 0, 0, 0, 1, 0};
    uint32_t chunk = 1;
    oc_header hdr = {OC_CONTRIB, 0, 0, 0, 0, OC_AGGREGATOR, 1, sizeof payload, 0};
    oc_agg_receive_run(a, h, &hdr, &chunk, 1, payload, 0, sizeof payload, 0.0);
    CHECK(oc_agg_pool_bytes(a) > 0, "a reduction in flight");
    int h2 = oc_agg_register(a, 1, 1, 3, 0, 0, OC_MAX_DATAGRAM, NULL, 0, &granted);
    CHECK(h2 == h && oc_agg_pool_bytes(a) == 0, "registered again with another world: freed");
    CHECK(oc_agg_register(a, 1, 1, 0, 0, 0, OC_MAX_DATAGRAM, NULL, 0, &granted) == -1, "a world of 0 is refused");
    oc_agg_free(a);
}

static void count_address(void *ctx, const struct sockaddr_in *address) {
    (void)address;
    ++*(int *)ctx;
}

/* A message for every rank goes to the group once every rank hears it, else to every rank's
 * address, however many there are. */
static void test_destinations(void) {
    enum { BIG = 300 };
    oc_agg *a = oc_agg_new(1);
    uint32_t granted;
    int h = oc_agg_register(a, 1, 1, BIG, 0, 0, OC_MAX_DATAGRAM, NULL, 0, &granted), n = 0;
    for (uint32_t r = 0; r < BIG; r++) oc_agg_set_address(a, h, r, 0x0100007f, (uint16_t)r, 1);
    oc_agg_each_destination(a, h, OC_ANY, count_address, &n);
    CHECK(n == BIG, "no group known: every rank's address (%d)", n);
    oc_agg_set_group(a, h, 0x010000ef, 9);
    n = 0;
    oc_agg_each_destination(a, h, OC_ANY, count_address, &n);
    CHECK(n == 1, "every rank hears the group: the group alone");
    oc_agg_set_address(a, h, 7, 0x0100007f, 7, 0);
    n = 0;
    oc_agg_each_destination(a, h, OC_ANY, count_address, &n);
    CHECK(n == BIG, "one rank does not hear it: every address again");
    n = 0;
    oc_agg_each_destination(a, h, 5, count_address, &n);
    oc_agg_each_destination(a, h, BIG, count_address, &n);
    CHECK(n == 1, "one rank's own address; none for a rank outside the world");
    oc_agg_free(a);
}

/* -- batched UDP on loopback -------------------------------------------------------------- */

static int udp_socket(struct sockaddr_in *bound) {
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    bind(fd, (struct sockaddr *)&a, sizeof a);
    getsockname(fd, (struct sockaddr *)bound, &len);
    return fd;
}

static void test_udp(void) {
    struct sockaddr_in to, from;
    int rx = udp_socket(&to), tx = udp_socket(&from);
    oc_udp r, t;
    CHECK(oc_udp_init(&r, rx) == 0 && oc_udp_init(&t, tx) == 0, "sockets");
    size_t segment, got_bytes = 0;
    int misfit;
    CHECK(oc_udp_read(&r, &segment, &misfit) == 0, "nothing waiting: 0");
    /* five datagrams of 1000 bytes and one of 300, in one send where GSO is offered */
    uint8_t batch[5300];
    for (size_t i = 0; i < sizeof batch; i++) batch[i] = (uint8_t)(i / 1000 + 1);
    CHECK(oc_udp_send(&t, batch, sizeof batch, 1000, &to) == (ssize_t)sizeof batch, "all sent");
    CHECK(t.datagrams_out == 6 && t.bytes_out == sizeof batch, "counted as six datagrams");
    int datagrams = 0, in_order = 1;
    for (;;) {
        ssize_t n = oc_udp_read(&r, &segment, &misfit);
        if (n <= 0) break;
        for (size_t at = 0; at < (size_t)n; at += segment, datagrams++)
            if (r.buf[at] != datagrams + 1) in_order = 0;
        got_bytes += (size_t)n;
    }
    CHECK(got_bytes == sizeof batch && datagrams == 6 && in_order && misfit == OC_UDP_WHOLE,
          "read back whole, cut at the segment size the kernel reports (%d datagrams)", datagrams);
    CHECK(r.datagrams_in == 6 && r.bytes_in == sizeof batch, "counted on the way in");
    /* an empty datagram is a misfit to pass over, not "nothing waiting": what follows it is read */
    CHECK(sendto(tx, batch, 0, 0, (struct sockaddr *)&to, sizeof to) == 0 &&
          sendto(tx, batch, 7, 0, (struct sockaddr *)&to, sizeof to) == 7, "sent");
    CHECK(oc_udp_read(&r, &segment, &misfit) == -1 && misfit == OC_UDP_EMPTY, "empty: -1");
    CHECK(oc_udp_read(&r, &segment, &misfit) == 7 && misfit == OC_UDP_WHOLE, "then the next");
    /* a batch the kernel finds too large for one send goes one datagram at a time; GSO stays on
     * for the batches after it */
    static uint8_t big[70 * 1000];
    int gso = t.gso;
    CHECK(oc_udp_send(&t, big, sizeof big, 1000, &to) == (ssize_t)sizeof big &&
          t.gso == gso && t.send_errors == 0, "too large for GSO: one by one, GSO kept");
    /* an error of the socket (broadcast not allowed) loses the batch, counted as errors, not
     * as a full socket */
    struct sockaddr_in everyone = {.sin_family = AF_INET, .sin_port = to.sin_port,
                                   .sin_addr.s_addr = htonl(INADDR_BROADCAST)};
    CHECK(oc_udp_send(&t, batch, sizeof batch, 1000, &everyone) == (ssize_t)sizeof batch &&
          t.send_errors == 6, "refused: all six counted lost (%llu)",
          (unsigned long long)t.send_errors);
    t.gso = 0;
    CHECK(oc_udp_send(&t, batch, sizeof batch, 1000, &everyone) == (ssize_t)sizeof batch &&
          t.send_errors == 12, "one by one too");
    CHECK(ERR_peek_error() == 0, "OpenSSL's error queue left empty");
    oc_udp_free(&r);
    oc_udp_free(&t);
    close(rx);
    close(tx);
}

/* The loop: its deadline, a control descriptor, and a reduction's datagrams end to end. */
static void test_serve(void) {
    struct sockaddr_in agg_addr, rank_addr;
    int afd = udp_socket(&agg_addr), rfd = udp_socket(&rank_addr), pipe_fds[2];
    CHECK(pipe(pipe_fds) == 0, "pipe");
    oc_udp u;
    oc_udp_init(&u, afd);
    oc_agg *a = oc_agg_new(16);
    uint32_t granted;
    int h = oc_agg_register(a, 1, 1, 2, 0, 0, OC_MAX_DATAGRAM, KEY, 0, &granted);
    oc_agg_set_address(a, h, 0, rank_addr.sin_addr.s_addr, rank_addr.sin_port, 0);
    oc_serve_stats stats = {0};
    int waiter = oc_serve_waiter(&u, pipe_fds, 1);
    CHECK(waiter >= 0, "a waiter on the socket and the pipe");
    double t0 = oc_monotonic();
    CHECK(oc_serve(a, &u, waiter, t0 + 0.05, &stats) == OC_SERVE_DEADLINE &&
          oc_monotonic() >= t0 + 0.05, "nothing to do: back at the deadline");
    CHECK(write(pipe_fds[1], "x", 1) == 1, "write");
    CHECK(oc_serve(a, &u, waiter, oc_monotonic() + 5, &stats) == 0,
          "a readable control descriptor ends the call with its index");
    char drained;
    CHECK(read(pipe_fds[0], &drained, 1) == 1, "read");
    /* rank 1 contributes to chunk 0 (rank 0's, of 2 chunks): the result reaches rank 0 */
    oc_sealer rank1 = {.job = 1, .comm = 1, .src = 1};
    oc_gmac_init(&rank1.gmac, KEY, 1);
    uint8_t payload[12 + 8] = {OC_INT32, 1, 2, 0, 2, 0, 0, 0, 0, 0, 1, 0, 7, 0, 0, 0, 9, 0, 0, 0}, msg[128];
    size_t n = oc_seal_into(&rank1, msg, sizeof msg, OC_CONTRIB, 0, OC_AGGREGATOR, 0, payload,
                            sizeof payload);
    sendto(rfd, msg, n, 0, (struct sockaddr *)&agg_addr, sizeof agg_addr);
    oc_serve(a, &u, waiter, oc_monotonic() + 0.1, &stats);
    uint8_t back[256];
    ssize_t got = recv(rfd, back, sizeof back, MSG_DONTWAIT);
    oc_header hdr;
    int32_t sum[2] = {0, 0};
    if (got >= (ssize_t)OC_OVERHEAD_BYTES && oc_header_parse(back, (size_t)got, &hdr) == 0 &&
        hdr.length == 8)
        memcpy(sum, back + OC_HEADER_BYTES, 8);
    CHECK(got > 0 && hdr.kind == OC_RESULT && hdr.chunk == 0 && sum[0] == 7 && sum[1] == 9,
          "the result came back to rank 0's address, sealed");
    CHECK(stats.wakeups > 0 && stats.cpu_seconds > 0, "the loop counted itself");
    oc_gmac_free(&rank1.gmac);
    oc_agg_free(a);
    oc_udp_free(&u);
    close(waiter);
    close(afd);
    close(rfd);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
}

/* Waits up to a few seconds for one datagram on fd (the shards serve on their own threads). */
static ssize_t recv_within(int fd, uint8_t *buf, size_t cap) {
    for (int i = 0; i < 500; i++) {
        ssize_t got = recv(fd, buf, cap, MSG_DONTWAIT);
        if (got > 0) return got;
        struct timespec t = {0, 10000000};
        nanosleep(&t, NULL);
    }
    return -1;
}

/* Two shards on their own threads: a communicator registered in both while they are parked,
 * each taking its stripe's contributions and sealing its results as its own endpoint. With
 * `no_descriptors_left`, the process may open no descriptor once they have started, as a
 * service whose every descriptor a crowd of connections holds: they serve all the same. Not
 * among the tests run on threads at once, which open descriptors. */
static void test_shards(int no_descriptors_left) {
    struct sockaddr_in addr[2], rank_addr;
    int fds[2] = {udp_socket(&addr[0]), udp_socket(&addr[1])}, rfd = udp_socket(&rank_addr);
    oc_shards *s = oc_shards_new(2, 16, 300, fds);
    CHECK(s && oc_shards_start(s) == 0, "two shards started");
    if (s == NULL) return;
    struct rlimit was;
    getrlimit(RLIMIT_NOFILE, &was);
    if (no_descriptors_left) {
        int lowest = dup(0); /* every descriptor below it is open */
        close(lowest);
        struct rlimit none = {(rlim_t)lowest, was.rlim_max};
        CHECK(setrlimit(RLIMIT_NOFILE, &none) == 0 && dup(0) < 0 && errno == EMFILE,
              "no descriptor left to open");
    }
    oc_shards_pause(s);
    for (uint32_t i = 0; i < 2; i++) {
        uint32_t granted;
        oc_agg *a = oc_shards_engine(s, i);
        int h = oc_agg_register(a, 1, 1, 2, i, 0, OC_MAX_DATAGRAM, KEY, 0, &granted);
        oc_agg_set_address(a, h, 0, rank_addr.sin_addr.s_addr, rank_addr.sin_port, 0);
        oc_agg_set_address(a, h, 1, rank_addr.sin_addr.s_addr, rank_addr.sin_port, 0);
    }
    oc_shards_resume(s);
    /* 4 chunks of a world of 2 in groups of 1: endpoint 0 has g = 0, 2 (rank 0's), endpoint 1
     * has g = 1, 3 (rank 1's); each rank contributes to the other's, as its chunk h = 0 */
    int32_t got_sums[2] = {0, 0};
    for (uint32_t rank = 0; rank < 2; rank++) {
        oc_sealer r = {.job = 1, .comm = 1, .src = (uint16_t)rank};
        oc_gmac_init(&r.gmac, KEY, 1);
        uint32_t e = 1 - rank;
        uint8_t payload[12 + 4] = {OC_INT32, 1, 2, 0, 4, 0, 0, 0, (uint8_t)e, 0, 2, 0,
                                   (uint8_t)(40 + rank), 0, 0, 0}, msg[128], back[256];
        size_t n = oc_seal_into(&r, msg, sizeof msg, OC_CONTRIB, 0, (uint16_t)(OC_AGGREGATOR - e),
                                0, payload, sizeof payload);
        sendto(rfd, msg, n, 0, (struct sockaddr *)&addr[e], sizeof addr[e]);
        oc_header hdr = {0};
        ssize_t got;
        do got = recv_within(rfd, back, sizeof back);
        while (got > 0 && oc_header_parse(back, (size_t)got, &hdr) == 0 && hdr.kind != OC_RESULT);
        if (got >= (ssize_t)OC_OVERHEAD_BYTES + 4 && hdr.kind == OC_RESULT)
            memcpy(&got_sums[e], back + OC_HEADER_BYTES, 4);
        CHECK(got > 0 && hdr.src == OC_AGGREGATOR - e && hdr.dst == e && hdr.chunk == 0,
              "endpoint %u's result came as that endpoint, to its owner", e);
        oc_gmac_free(&r.gmac);
    }
    CHECK(got_sums[0] == 41 && got_sums[1] == 40, "each shard summed its stripe");
    oc_shards_pause(s);
    uint64_t taken = 0;
    for (uint32_t i = 0; i < 2; i++)
        taken += oc_agg_stats(oc_shards_engine(s, i))[OC_STAT_contributions];
    CHECK(taken == 2 && oc_agg_stats(oc_shards_engine(s, 0))[OC_STAT_contributions] == 1,
          "one contribution each, read while they are parked");
    oc_shards_resume(s);
    setrlimit(RLIMIT_NOFILE, &was);
    oc_shards_free(s);
    for (int i = 0; i < 2; i++) close(fds[i]);
    close(rfd);
}

/* -- the rank's side ----------------------------------------------------------------------- */

static void test_budget(void) {
    oc_budget b;
    oc_budget_init(&b, 1000.0, 0.005, 2, 100, 4);
    CHECK(b.burst == 800 && b.tokens == 800 && b.reduction_batch == 4, "burst: two batches");
    CHECK(oc_budget_try_take(&b, 800, 0.0) && !oc_budget_try_take(&b, 100, 0.0),
          "the bucket holds its burst, then nothing");
    CHECK(fabs(oc_budget_ready_at(&b, 100, 0.0) - 0.1) < 1e-9, "100 bytes at 1000 B/s: 0.1 s");
    oc_budget_take(&b, 500, 0.0);
    CHECK(b.tokens == -500, "multicast may run it into debt");
    CHECK(oc_budget_try_take(&b, 100, 0.6) && fabs(b.tokens) < 1e-9, "refilled at the rate");
    oc_budget_init(&b, 0, 0.005, 1, 100, 1);
    CHECK(oc_budget_try_take(&b, 1e12, 0.0) && oc_budget_ready_at(&b, 1e12, 3.0) == 3.0,
          "unpaced: always");
}

enum { RW = 3, RCOUNT = 1000, RCHUNK = 64 };

typedef struct {
    oc_agg *agg;
    int handle;
    oc_plane *planes[RW];
    double now;
    int to_aggregator; /* emit's target: the aggregator, or the ranks */
} bench_t;

static void to_aggregator(void *ctx, uint8_t route, uint16_t dst, const uint8_t *data,
                          size_t len, size_t segment) {
    bench_t *b = ctx;
    (void)route;
    (void)dst;
    oc_agg_feed(b->agg, data, len, segment, b->now);
}

static void to_ranks(void *ctx, int handle, uint16_t dst, const uint8_t *data, size_t len,
                     size_t segment) {
    bench_t *b = ctx;
    (void)handle;
    for (uint32_t r = 0; r < RW; r++)
        if (dst == OC_ANY || dst == r) oc_plane_feed(b->planes[r], data, len, segment, b->now);
}

/* The aggregator, registered as endpoint `endpoint` (the only one left of endpoint + 1 when
 * above 0: the planes stripe over it alone), and RW planes, each with reduction 4 of random
 * inputs posted. */
static void bench_reduce(bench_t *b, oc_sealer *sealers, oc_budget *budgets,
                         int32_t in[RW][RW * RCOUNT], int32_t out[RW][RCOUNT], double loss,
                         uint16_t endpoint) {
    uint32_t granted;
    b->agg = oc_agg_new(16);
    b->handle = oc_agg_register(b->agg, 9, 8, RW, endpoint, 0, OC_MAX_DATAGRAM, KEY, 0,
                                &granted);
    for (uint32_t r = 0; r < RW; r++) {
        sealers[r] = (oc_sealer){.job = 9, .comm = 8, .src = (uint16_t)r};
        oc_gmac_init(&sealers[r].gmac, KEY, 1);
        oc_budget_init(&budgets[r], 1e6, 0.005, 4, RCHUNK + 100, 4);
        b->planes[r] = oc_plane_new((uint16_t)r, RW, 9, 8, KEY, &sealers[r]);
        oc_plane_set_loss(b->planes[r], loss, 2, 7);
        if (endpoint)
            CHECK(oc_plane_set_stripes(b->planes[r], endpoint + 1u) == 0 &&
                  oc_plane_set_lanes(b->planes[r], (uint16_t[]){endpoint}, 0) != 0 &&
                  oc_plane_set_lanes(b->planes[r], (uint16_t[]){endpoint + 1u}, 1) != 0 &&
                  oc_plane_set_lanes(b->planes[r], (uint16_t[]){endpoint, endpoint}, 2) != 0 &&
                  oc_plane_set_lanes(b->planes[r], (uint16_t[]){endpoint}, 1) == 0,
                  "lanes: one of the stripes set, none twice");
        for (int i = 0; i < RW * RCOUNT; i++) in[r][i] = (int32_t)(next() % 2001) - 1000;
        memset(out[r], 0xAB, sizeof out[r]);
        CHECK(oc_plane_reduce(b->planes[r], 4, OC_INT32, 0, RCOUNT, (uint8_t *)in[r],
                              (uint8_t *)out[r], RCHUNK, 16, 4, &budgets[r], 0.0) == 0,
              "posted");
        CHECK(budgets[r].reductions_in_flight == 1, "counted in flight");
    }
}

/* Three ranks' planes and the aggregator exchange sealed datagrams in memory, with loss
 * injected at every rank: the sums are exact and every reduction drains; also where the
 * aggregator is endpoint 1, the only one left of two (its contributions say place 0 of 1). */
static void test_rank_planes_with_the_aggregator(double loss, uint16_t endpoint) {
    bench_t b = {0};
    oc_sealer sealers[RW];
    oc_budget budgets[RW];
    int32_t in[RW][RW * RCOUNT], out[RW][RCOUNT];
    bench_reduce(&b, sealers, budgets, in, out, loss, endpoint);
    CHECK(oc_plane_reduce(b.planes[0], 4, OC_INT32, 0, RCOUNT, (uint8_t *)in[0],
                          (uint8_t *)out[0], RCHUNK, 16, 4, &budgets[0], 0.0) != 0,
          "a sequence number is posted once");
    int drained[RW] = {0}, all = 0;
    for (int step = 0; step < 200000 && !all; step++) {
        for (uint32_t r = 0; r < RW; r++) {
            oc_plane_handle_timer(b.planes[r], b.now);
            oc_outbox_seal(oc_plane_outbox(b.planes[r]), &sealers[r], to_aggregator, &b);
        }
        oc_agg_handle_timer(b.agg, b.now);
        oc_agg_flush(b.agg, to_ranks, &b);
        all = 1;
        for (uint32_t r = 0; r < RW; r++) {
            uint32_t seq;
            if (oc_plane_news(b.planes[r], &seq, 1)) drained[r]++;
            all &= drained[r] == 1;
        }
        b.now += 0.0005;
    }
    int exact = 1;
    for (uint32_t r = 0; r < RW; r++)
        for (int i = 0; i < RCOUNT; i++) {
            uint32_t sum = 0;
            for (uint32_t q = 0; q < RW; q++) sum += (uint32_t)in[q][r * RCOUNT + i];
            exact &= out[r][i] == (int32_t)sum;
        }
    CHECK(all && exact, "loss %.2f, endpoint %u: every rank drained once (%d %d %d), sums "
          "exact %d", loss, endpoint, drained[0], drained[1], drained[2], exact);
    uint64_t lost = 0;
    for (uint32_t r = 0; r < RW; r++) {
        lost += oc_plane_stats(b.planes[r])[OC_PLANE_STAT_injected_losses];
        const uint64_t *d = oc_plane_drops(b.planes[r]);
        CHECK(d[OC_PLANE_DROP_bad_mac] == 0 && d[OC_PLANE_DROP_malformed] == 0 &&
              d[OC_PLANE_DROP_out_of_range] == 0, "nothing dropped but the injected loss");
        oc_plane_release(b.planes[r], 4);
        CHECK(budgets[r].reductions_in_flight == 0 && oc_plane_reducer(b.planes[r], 4) == NULL,
              "released");
        oc_plane_free(b.planes[r]);
        oc_gmac_free(&sealers[r].gmac);
    }
    CHECK((loss > 0) == (lost > 0), "loss injected: %llu", (unsigned long long)lost);
    oc_agg_free(b.agg);
}

/* An aggregator lost mid-reduction: rank 0 freezes its reduction (oc_plane_release) once some
 * of its results are in. From then on its output does not change, it sends nothing more for
 * the reduction (no acknowledgement: the other ranks cannot drain), and the endpoint, which
 * goes on sending its results again, is still heard. */
static void test_a_frozen_reduction_takes_and_acknowledges_nothing(void) {
    bench_t b = {0};
    oc_sealer sealers[RW];
    oc_budget budgets[RW];
    int32_t in[RW][RW * RCOUNT], out[RW][RCOUNT], frozen[RCOUNT];
    bench_reduce(&b, sealers, budgets, in, out, 0.0, 0);
    CHECK(oc_plane_heard(b.planes[0], 0) < 0 && oc_plane_heard(b.planes[0], OC_MAX_STRIPES) < 0,
          "nothing heard yet, nor past the endpoints");
    int released = 0, drained = 0;
    double froze_at = -1;
    for (int step = 0; step < 20000; step++) {
        for (uint32_t r = 0; r < RW; r++) {
            if (r == 0 && released) {
                CHECK(oc_plane_outbox(b.planes[0])->n == 0, "nothing queued once frozen");
            } else {
                oc_plane_handle_timer(b.planes[r], b.now);
            }
            oc_outbox_seal(oc_plane_outbox(b.planes[r]), &sealers[r], to_aggregator, &b);
        }
        oc_agg_handle_timer(b.agg, b.now);
        oc_agg_flush(b.agg, to_ranks, &b);
        const oc_reducer *r0 = oc_plane_reducer(b.planes[0], 4);
        if (!released && r0 && r0->results > 0 && r0->results < r0->k) {
            oc_plane_release(b.planes[0], 4);
            memcpy(frozen, out[0], sizeof frozen);
            froze_at = b.now;
            released = 1;
        }
        for (uint32_t r = 1; r < RW; r++) {
            uint32_t seq;
            drained += (int)oc_plane_news(b.planes[r], &seq, 1);
        }
        b.now += 0.0005;
    }
    CHECK(released && memcmp(frozen, out[0], sizeof frozen) == 0,
          "the frozen output took nothing more");
    CHECK(drained == 0, "no rank drained: rank 0 acknowledged nothing once frozen");
    CHECK(oc_plane_heard(b.planes[0], 0) > froze_at, "the endpoint is still heard: %f after %f",
          oc_plane_heard(b.planes[0], 0), froze_at);
    for (uint32_t r = 0; r < RW; r++) {
        oc_plane_release(b.planes[r], 4);
        CHECK(budgets[r].reductions_in_flight == 0, "released");
        oc_plane_free(b.planes[r]);
        oc_gmac_free(&sealers[r].gmac);
    }
    oc_agg_free(b.agg);
}

enum { GW = 3, GK = 37, GCHUNK = 40, GBYTES = GK * GCHUNK - 13 };

typedef struct {
    oc_plane *planes[GW];
    double now;
    uint16_t from;
} mesh_t;

static void to_group(void *ctx, uint8_t route, uint16_t dst, const uint8_t *data, size_t len,
                     size_t segment) {
    mesh_t *m = ctx;
    (void)dst;
    if (route != OC_ROUTE_GROUP) return;
    for (uint16_t r = 0; r < GW; r++)
        if (r != m->from) oc_plane_feed(m->planes[r], data, len, segment, m->now);
}

/* Two gathers in flight at once share the streams' pace (each gets half, and half the batch)
 * until one is released, sent or not, or every root of it has ended its multicast. */
static void test_gathers_share_the_link(void) {
    oc_budget b; /* 1e4 B/s, 32 datagrams a batch: 2 streams a receiver, 5e3 B/s and 16 each */
    oc_budget_init(&b, 1e4, 0.005, 32, GCHUNK + 100, 32);
    static uint8_t buffers[2][GW * GBYTES];
    uint32_t roots[GW] = {0, 1, 2};
    uint64_t offsets[GW] = {0, GBYTES, 2 * GBYTES};
    oc_outbox o = {0};
    oc_gather g[2];
    for (int i = 0; i < 2; i++)
        CHECK(oc_gather_init(&g[i], (uint32_t)i, GW, buffers[i], GW, roots, offsets, GBYTES,
                             GCHUNK, 0, GW - 1, &b) == 0,
              "gather %d", i);
    double full = OC_LINK_BYTES(GCHUNK);
    CHECK(b.gathers_in_flight == 2, "two gathers in flight");
    oc_gather_activate(&g[1], &o, 0);
    CHECK(g[1].next_chunk == 8 && fabs(g[1].next_send - 8 * full / 2.5e3) < 1e-9,
          "beside another: a batch of 8 at 2.5e3 B/s");
    oc_gather_free(&g[1]);
    oc_gather_free(&g[1]); /* twice: counted once */
    CHECK(b.gathers_in_flight == 1, "released while sending: its share handed back");
    oc_gather_activate(&g[0], &o, 0);
    CHECK(g[0].next_chunk == 16 && fabs(g[0].next_send - 16 * full / 5e3) < 1e-9,
          "alone: a batch of 16 at 5e3 B/s");
    for (double now = 0; !g[0].sent_all && now < 100; now += 0.01)
        oc_gather_handle_timer(&g[0], &o, now);
    CHECK(g[0].sent_all && b.gathers_in_flight == 1, "all sent, still in flight");
    CHECK(oc_gather_streams_ended(&g[0]) && oc_gather_streams_ended(&g[0]) && /* counted once */
              b.gathers_in_flight == 0,
          "every root ended: no longer sharing the pace");
    oc_gather_free(&g[0]);
    CHECK(b.gathers_in_flight == 0, "freed after: not counted again");
    CHECK(oc_gather_init(&g[0], 2, GW, buffers[0], GW, roots, offsets, GBYTES, GCHUNK, 0,
                         GW - 1, &b) == 0 &&
              oc_gather_init(&g[1], 3, GW, buffers[1], GW, roots, offsets, GBYTES, GCHUNK, -1,
                             GW - 1, &b) == 0,
          "two more, the second only received here");
    CHECK(!oc_gather_streams_ended(&g[0]) && b.gathers_in_flight == 2 && g[0].pacing,
          "its own segment not sent: still sharing");
    CHECK(oc_gather_streams_ended(&g[1]), "only received here: taken");
    oc_gather_activate(&g[0], &o, 0);
    CHECK(b.gathers_in_flight == 1 && g[0].next_chunk == 16 &&
              fabs(g[0].next_send - 16 * full / 5e3) < 1e-9,
          "beside one whose streams ended: alone, a batch of 16 at 5e3 B/s");
    oc_gather_free(&g[0]);
    oc_gather_free(&g[1]);
    CHECK(b.gathers_in_flight == 0, "none in flight");
    oc_outbox_free(&o);
}

/* Three planes multicast their segments to each other, paced, with loss: what is lost is
 * requested (the gaps the plane saw, then the tail), repaired in place as a successor's repair
 * would, and every buffer ends the same as the sources. */
static void test_gathers(double loss) {
    mesh_t m = {0};
    oc_sealer sealers[GW];
    oc_budget budgets[GW];
    static uint8_t buffers[GW][GW * GBYTES];
    uint32_t roots[GW];
    uint64_t offsets[GW];
    for (uint32_t s = 0; s < GW; s++) {
        roots[s] = s;
        offsets[s] = (uint64_t)s * GBYTES;
    }
    for (uint16_t r = 0; r < GW; r++) {
        sealers[r] = (oc_sealer){.job = 3, .comm = 4, .src = r};
        oc_gmac_init(&sealers[r].gmac, KEY, 1);
        oc_budget_init(&budgets[r], 2e5, 0.005, 3, GCHUNK + 100, 3);
        m.planes[r] = oc_plane_new(r, GW, 3, 4, KEY, &sealers[r]);
        oc_plane_set_loss(m.planes[r], loss, 1, 11);
        memset(buffers[r], 0xEE, sizeof buffers[r]);
        for (int i = 0; i < GBYTES; i++) buffers[r][r * GBYTES + i] = (uint8_t)(r * 31 + i);
        CHECK(oc_plane_gather(m.planes[r], 2, buffers[r], GW, roots, offsets, GBYTES, GCHUNK, r,
                              GW - 1, &budgets[r]) == 0, "posted");
        oc_gather_activate(oc_plane_gatherer(m.planes[r], 2), oc_plane_outbox(m.planes[r]), 0);
    }
    int sent = 0;
    for (int step = 0; step < 20000 && sent < GW; step++) {
        sent = 0;
        for (uint16_t r = 0; r < GW; r++) {
            m.from = r;
            oc_plane_handle_timer(m.planes[r], m.now);
            oc_outbox_seal(oc_plane_outbox(m.planes[r]), &sealers[r], to_group, &m);
            sent += oc_plane_gatherer(m.planes[r], 2)->sent_all;
        }
        m.now += 0.0002;
    }
    CHECK(sent == GW, "every segment sent");
    /* what is still missing is asked for (the tail), then every request is repaired from its
     * root's buffer, as the repairs over the streams would */
    size_t requested = 0;
    for (uint16_t r = 0; r < GW; r++) {
        oc_gather *g = oc_plane_gatherer(m.planes[r], 2);
        for (uint32_t s = 0; s < GW; s++) oc_gather_request(g, s, 0, GK);
        requested += g->nrequests;
        for (size_t i = 0; i < g->nrequests; i++) {
            oc_range q = g->requests[i];
            uint32_t root = q.first / GK, fresh;
            uint64_t a = offsets[root] + (uint64_t)(q.first % GK) * GCHUNK;
            uint64_t b = offsets[root] + (uint64_t)(q.first % GK + q.count) * GCHUNK;
            if (b > offsets[root] + GBYTES) b = offsets[root] + GBYTES;
            CHECK(oc_gather_store(g, q.first, buffers[root] + a, b - a, m.now, &fresh) == OC_FIT &&
                      fresh == q.count,
                  "a requested range is repaired whole");
            CHECK(oc_gather_have(g, q.first, q.count) == 1, "and is here");
        }
        g->nrequests = 0;
        CHECK(oc_gather_complete(g), "rank %u complete", r);
    }
    CHECK((loss > 0) == (requested > 0), "loss %.2f: %zu ranges requested", loss, requested);
    int same = 1;
    for (uint16_t r = 1; r < GW; r++) same &= !memcmp(buffers[r], buffers[0], sizeof buffers[0]);
    CHECK(same, "every buffer holds every segment");
    uint32_t fresh;
    oc_gather *g0 = oc_plane_gatherer(m.planes[0], 2);
    CHECK(oc_gather_store(g0, GK - 1, buffers[0], GCHUNK, 0, &fresh) == OC_MISFIT_WRONG_LENGTH,
          "a last chunk is shorter");
    CHECK(oc_gather_store(g0, GK - 1, buffers[0], 2 * GCHUNK, 0, &fresh) ==
              OC_MISFIT_OUT_OF_RANGE,
          "a repair across two segments");
    CHECK(oc_gather_have(g0, GK * GW, 1) == -1 && oc_gather_have(g0, GK - 1, 2) == -1,
          "have: only ranges of one segment");
    for (uint16_t r = 0; r < GW; r++) {
        oc_plane_release(m.planes[r], 2);
        CHECK(oc_plane_gatherer(m.planes[r], 2) == NULL, "released");
        oc_plane_free(m.planes[r]);
        oc_gmac_free(&sealers[r].gmac);
    }
}

/* Whatever does not fit is dropped and counted by reason, never taken. */
static void test_plane_drops(void) {
    oc_sealer agg = {.job = 9, .comm = 8, .src = OC_AGGREGATOR}, rank2 = {.job = 9, .comm = 8,
                                                                          .src = 2};
    oc_sealer outsider = {.job = 9, .comm = 8, .src = 7}, foreign = {.job = 10, .comm = 8,
                                                                     .src = OC_AGGREGATOR};
    oc_gmac_init(&agg.gmac, KEY, 1);
    oc_gmac_init(&rank2.gmac, KEY, 1);
    oc_gmac_init(&outsider.gmac, KEY, 1);
    oc_gmac_init(&foreign.gmac, KEY, 1);
    oc_budget budget;
    oc_budget_init(&budget, 0, 0.005, 1, 0, 1);
    oc_plane *p = oc_plane_new(1, 3, 9, 8, KEY, NULL);
    int32_t in[300], out[100];
    memset(in, 0, sizeof in);
    oc_plane_reduce(p, 0, OC_INT32, 0, 100, (uint8_t *)in, (uint8_t *)out, 64, 8, 1, &budget, 0);
    uint8_t d[512], payload[64] = {0};
    size_t n;
    const uint64_t *drops = oc_plane_drops(p);
    /* chunk 1 of 3 x 7 is block 1's (group 1: c * P + b) */
#define FEED(sealer, kind, dst, chunk, len)                                                       \
    (n = oc_seal_into(&(sealer), d, sizeof d, kind, 0, dst, chunk, payload, len),             \
     oc_plane_feed(p, d, n, n, 0.0))
    FEED(agg, OC_RESULT, 1, 1, 64);
    CHECK(oc_plane_reducer(p, 0)->results == 1, "a result that fits is taken");
    FEED(agg, OC_RESULT, 1, 1, 64);
    CHECK(oc_plane_reducer(p, 0)->duplicate_results == 1, "a copy is counted as one");
    oc_plane_feed(p, d, n, n, 0.0);
    CHECK(drops[OC_PLANE_DROP_replayed] == 1, "the same datagram again: replayed");
    FEED(agg, OC_RESULT, 1, 0, 64);
    CHECK(drops[OC_PLANE_DROP_out_of_range] == 1, "block 0's chunk: out of range");
    FEED(agg, OC_RESULT, 1, 99, 64);
    CHECK(drops[OC_PLANE_DROP_out_of_range] == 2, "past the last chunk: out of range");
    FEED(agg, OC_RESULT, 1, 4, 60);
    CHECK(drops[OC_PLANE_DROP_wrong_length] == 1, "short: wrong length");
    FEED(agg, OC_RESULT, 2, 4, 64);
    CHECK(drops[OC_PLANE_DROP_misdirected] == 1, "for rank 2: misdirected");
    FEED(rank2, OC_RESULT, 1, 4, 64);
    CHECK(drops[OC_PLANE_DROP_wrong_sender] == 1, "a result from a rank: wrong sender");
    FEED(outsider, OC_RESULT, 1, 4, 64);
    CHECK(drops[OC_PLANE_DROP_wrong_sender] == 2, "from outside the world: wrong sender");
    FEED(foreign, OC_RESULT, 1, 4, 64);
    CHECK(drops[OC_PLANE_DROP_foreign] == 1, "another job: foreign");
    FEED(agg, OC_CREDIT, 1, 0, 3);
    CHECK(drops[OC_PLANE_DROP_malformed] == 1, "a credit of 3 bytes: malformed");
    payload[0] = 200;
    FEED(agg, OC_CREDIT, 1, 0, 4);
    CHECK(drops[OC_PLANE_DROP_out_of_range] == 3, "credit past the last chunk: out of range");
    payload[0] = 0;
    n = oc_seal_into(&agg, d, sizeof d, OC_RESULT, 0, 1, 4, payload, 64);
    d[OC_HEADER_BYTES + 5] ^= 1;
    oc_plane_feed(p, d, n, n, 0.0);
    CHECK(drops[OC_PLANE_DROP_bad_mac] == 1, "a flipped bit: bad MAC");
    oc_plane_feed(p, d, 20, 20, 0.0);
    CHECK(drops[OC_PLANE_DROP_malformed] == 2, "20 bytes: malformed");
    FEED(agg, OC_MCAST_DATA, 1, 4, 64);
    const oc_run *runs;
    const uint32_t *chunks;
    CHECK(oc_plane_runs(p, &runs, &chunks) == 1 && runs[0].hdr.kind == OC_MCAST_DATA &&
              chunks[runs[0].first] == 4,
          "a kind that is not the plane's goes to Python");
    CHECK(oc_plane_reducer(p, 0)->results == 1, "nothing that misfit was taken");
    static uint8_t gbuf[3 * 100];
    uint32_t roots[3] = {0, 1, 2};
    uint64_t offsets[3] = {0, 100, 200};
    oc_plane_gather(p, 5, gbuf, 3, roots, offsets, 100, 64, 1, 2, &budget);
    uint8_t big[64] = {0};
    memcpy(payload, big, 64);
#define MCAST(sealer, dst, chunk, len)                                                            \
    (n = oc_seal_parts(&(sealer), d, sizeof d, OC_MCAST_DATA, 5, dst, chunk, NULL, 0, payload,   \
                       len),                                                                      \
     oc_plane_feed(p, d, n, n, 0.0))
    MCAST(agg, OC_ANY, 0, 64);
    CHECK(drops[OC_PLANE_DROP_wrong_sender] == 3, "multicast from the aggregator: wrong sender");
    MCAST(rank2, OC_ANY, 0, 64);
    CHECK(drops[OC_PLANE_DROP_out_of_range] == 4, "rank 2's chunk 0 is rank 0's: out of range");
    MCAST(rank2, OC_ANY, 5, 64);
    CHECK(drops[OC_PLANE_DROP_wrong_length] == 2, "its last chunk holds 36 bytes: wrong length");
    MCAST(rank2, 0, 4, 64);
    CHECK(drops[OC_PLANE_DROP_misdirected] == 2, "for rank 0 alone: misdirected");
    MCAST(rank2, OC_ANY, 4, 64);
    CHECK(oc_plane_gatherer(p, 5)->multicast_chunks == 1 && !memcmp(gbuf + 200, big, 64),
          "rank 2's first chunk in place");
    CHECK(oc_plane_runs(p, &runs, &chunks) == 0, "and not Python's");
#undef MCAST
    oc_plane_free(p);
    oc_gmac_free(&agg.gmac);
    oc_gmac_free(&rank2.gmac);
    oc_gmac_free(&outsider.gmac);
    oc_gmac_free(&foreign.gmac);
#undef FEED
}

/* Two planes on loopback: a batch sent in one call comes back from serve as one run. */
static void test_port(void) {
    struct sockaddr_in to, from;
    int rx = udp_socket(&to), tx = udp_socket(&from), quiet[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, quiet) == 0, "socketpair");
    oc_sealer s0 = {.job = 9, .comm = 8, .src = 0}, s1 = {.job = 9, .comm = 8, .src = 1};
    oc_gmac_init(&s0.gmac, KEY, 1);
    oc_gmac_init(&s1.gmac, KEY, 1);
    oc_plane *sender = oc_plane_new(0, 2, 9, 8, KEY, &s0), *receiver = oc_plane_new(1, 2, 9, 8, KEY, &s1);
    oc_port ps, pr;
    CHECK(oc_port_init(&ps, sender, tx, -1, quiet[0]) == 0 &&
              oc_port_init(&pr, receiver, rx, -1, quiet[0]) == 0,
          "ports");
    oc_plane_set_address(sender, OC_ROUTE_RANK, 1, to.sin_addr.s_addr, to.sin_port);
    uint8_t chunk[5][1000];
    for (int i = 0; i < 5; i++) {
        memset(chunk[i], i, sizeof chunk[i]);
        oc_outbox_add(oc_plane_outbox(sender), OC_ROUTE_RANK, 1, OC_MCAST_DATA, 3, (uint32_t)i,
                      NULL, 0, chunk[i], sizeof chunk[i]);
    }
    oc_port_flush(&ps);
    CHECK(oc_plane_stats(sender)[OC_PLANE_STAT_datagram_sends] == 1 && ps.udp.datagrams_out == 5,
          "five datagrams, one send");
    size_t got = 0;
    int ok = 1;
    for (int tries = 0; tries < 10 && got < 5; tries++) {
        if (oc_port_serve(&pr, oc_monotonic() + 1.0) != OC_PORT_RUNS) continue;
        const oc_run *runs;
        const uint32_t *chunks;
        size_t n = oc_plane_runs(receiver, &runs, &chunks);
        for (size_t i = 0; i < n; i++)
            for (size_t j = 0; j < runs[i].count; j++) {
                uint32_t g = chunks[runs[i].first + j];
                ok &= g == got && !memcmp(pr.runs_data + runs[i].offset + j * runs[i].stride,
                                          chunk[g], sizeof chunk[g]);
                got++;
            }
    }
    CHECK(got == 5 && ok, "every chunk came, whole and in order (%zu)", got);
    CHECK(oc_port_serve(&pr, oc_monotonic() + 0.01) == OC_PORT_DEADLINE, "then quiet");
    CHECK(write(quiet[1], "x", 1) == 1, "wake");
    CHECK(oc_port_serve(&pr, oc_monotonic() - 1.0) == OC_PORT_PYTHON,
          "past its deadline, it still looks at its descriptors once");
    oc_port_free(&ps);
    oc_port_free(&pr);
    oc_plane_free(sender);
    oc_plane_free(receiver);
    oc_gmac_free(&s0.gmac);
    oc_gmac_free(&s1.gmac);
    close(rx);
    close(tx);
    close(quiet[0]);
    close(quiet[1]);
}

static void test_trace(void) {
    oc_trace t = {0};
    oc_trace_count(&t, 1, 7, 3, 100, 1.0);
    CHECK(t.n == 0, "off until a bin width is set");
    t.bin_seconds = 0.002;
    oc_trace_count(&t, 1, 7, 3, 100, 1.0001);
    oc_trace_count(&t, 1, 7, 1, 100, 1.0012);   /* the same bin and collective: merged */
    oc_trace_count(&t, 0, 7, 2, 8920, 1.0012);  /* the other direction */
    oc_trace_count(&t, 1, 8, 1, 100, 1.0013);   /* another collective */
    oc_trace_count(&t, 1, 7, 1, 100, 1.0031);   /* the next bin */
    CHECK(t.n == 4, "bins: %zu", t.n);
    uint64_t frame = 100 + OC_OVERHEAD_BYTES + 20 + 8 + 14;
    CHECK(t.bins[0].seq == 7 && t.bins[0].tx == 1 && t.bins[0].bin == 500 &&
              t.bins[0].bytes == 4 * frame, "merged: %llu", (unsigned long long)t.bins[0].bytes);
    CHECK(t.bins[1].tx == 0 && t.bins[1].bytes == 2 * (8920 + OC_OVERHEAD_BYTES + 42), "rx");
    CHECK(t.bins[2].seq == 8 && t.bins[3].bin == 501, "apart");
    for (int i = 0; i < 1000; i++) oc_trace_count(&t, i & 1, (uint32_t)i, 1, 1, 2.0);
    CHECK(t.n == 1004, "grows: %zu", t.n);
    oc_trace_clear(&t);
    CHECK(t.n == 0, "cleared");
    oc_trace_free(&t);
}

/* Tests that share nothing but the process (OpenSSL, the allocator, the kernel's sockets), each
 * on a thread of its own, all at once: what ThreadSanitizer checks (tests/test_native.py). */
static void *rank_planes(void *unused) { (void)unused; test_rank_planes_with_the_aggregator(0.05, 0); return NULL; }
static void *gathers(void *unused) { (void)unused; test_gathers(0.1); return NULL; }
static void *aggregator(void *unused) { (void)unused; test_aggregator(); return NULL; }
static void *port(void *unused) { (void)unused; test_port(); return NULL; }
static void *serve(void *unused) { (void)unused; test_serve(); return NULL; }
static void *shards(void *unused) { (void)unused; test_shards(0); return NULL; }
static void *sealing(void *unused) { (void)unused; test_seal_and_open(); test_seal_detached(); return NULL; }

static int at_once(void) {
    void *(*tests[])(void *) = {rank_planes, gathers, aggregator, port, serve, shards, sealing};
    enum { N = sizeof tests / sizeof tests[0] };
    pthread_t threads[N];
    for (int i = 0; i < N; i++) CHECK(pthread_create(&threads[i], NULL, tests[i], NULL) == 0, "thread");
    for (int i = 0; i < N; i++) pthread_join(threads[i], NULL);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "threads") == 0) return at_once();
    test_header();
    test_seal_and_open();
    test_fast_gmac();
    test_seal_detached();
    test_replay_window();
    test_stream_open();
    test_numbering();
    test_striping();
    test_conversions();
    test_sums();
    test_aggregator();
    test_credit_fits_the_path();
    test_reregistration();
    test_destinations();
    test_udp();
    test_serve();
    test_shards(0);
    test_shards(1);
    test_budget();
    test_rank_planes_with_the_aggregator(0.0, 0);
    test_rank_planes_with_the_aggregator(0.05, 0);
    test_rank_planes_with_the_aggregator(0.05, 1);
    test_a_frozen_reduction_takes_and_acknowledges_nothing();
    test_plane_drops();
    test_gathers_share_the_link();
    test_gathers(0.0);
    test_gathers(0.1);
    test_port();
    test_trace();
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
