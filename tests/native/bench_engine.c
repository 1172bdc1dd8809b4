/* The aggregator's engine alone, without sockets: P ranks' contributions to one reduction
 * (float32, `--mib` MiB per rank, 8,916-byte chunks as on 9000-byte MTU links), striped over
 * `--shards` engines, each on a thread of its own as the service's shards are, sealed
 * beforehand, fed as reads of up to 7 datagrams (what one GRO read holds), each rank's results
 * acknowledged in batches, the outbox sealed after every read. Each round is another reduction
 * of the same communicator, as a training job's are: the engine keeps its pool for the next. Prints the CPU per contribution
 * taken, the contributions taken per second of wall-clock time (all shards at once), and what
 * GMAC alone costs per datagram of that size. tools/bench_core builds and runs it. */
#define _POSIX_C_SOURCE 199309L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "aggregator/aggregator.h"
#include "common/numbering.h"

/* an 8,980-byte datagram, as a 9,000-byte MTU carries: header, prefix, data, tag */
enum { PREFIX = 12, CHUNK = 8980 - OC_OVERHEAD_BYTES - PREFIX, PER_READ = 7, SLOTS = 128 };
static const uint8_t KEY[16] = {42};

static double clock_of(clockid_t id) {
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void discard(void *ctx, int h, uint16_t dst, const uint8_t *d, size_t n, size_t seg) {
    (void)ctx, (void)h, (void)dst, (void)d, (void)n, (void)seg;
}

/* One shard's share: its engine and every rank's contributions to its chunks, sealed. */
typedef struct {
    unsigned world, stripe, stripes, seq, lane;
    uint32_t total;              /* its chunks in this round (numbering.h's lane) */
    uint32_t whole;              /* the reduction's */
    oc_agg *agg;
    oc_sealer *ranks;
    uint8_t *sealed;             /* chunk h's contribution from its i-th contributor at (h * (world - 1) + i) * PER */
    double cpu;
    uint64_t taken;
    int finished;
} shard_t;

static size_t per(void) { return OC_OVERHEAD_BYTES + PREFIX + CHUNK; }

static uint32_t owner(const shard_t *s, uint32_t h) {
    return (uint32_t)(oc_stripe_global(h, 1, s->stripes, s->lane) % s->world);
}

/* The engine and the ranks' sealers, once. */
static void start(shard_t *s) {
    s->agg = oc_agg_new(SLOTS);
    uint32_t granted;
    oc_agg_register(s->agg, 1, 1, s->world, s->stripe, 0, OC_MAX_DATAGRAM, KEY, 0, &granted);
    s->ranks = calloc(s->world, sizeof *s->ranks);
    for (unsigned r = 0; r < s->world; r++) {
        s->ranks[r] = (oc_sealer){.job = 1, .comm = 1, .src = (uint16_t)r};
        oc_gmac_init(&s->ranks[r].gmac, KEY, 1);
    }
    s->sealed = malloc(((size_t)s->whole / s->stripes + 1) * (s->world - 1) * per());
}

/* Round `seq`'s contributions, sealed. */
static void prepare(shard_t *s, uint8_t *payload, unsigned seq) {
    payload[8] = (uint8_t)s->stripe;
    payload[10] = (uint8_t)s->stripes;
    s->seq = seq;
    s->lane = oc_stripe_lane(s->stripe, seq, s->stripes);
    s->total = (uint32_t)oc_endpoint_count(s->whole, 1, s->stripes, s->stripe, seq);
    size_t n = 0;
    for (uint32_t h = 0; h < s->total; h++)
        for (unsigned r = 0; r < s->world; r++)
            if (r != owner(s, h))
                oc_seal_into(&s->ranks[r], s->sealed + n++ * per(), per(), OC_CONTRIB, seq,
                             (uint16_t)(OC_AGGREGATOR - s->stripe), h, payload, PREFIX + CHUNK);
}

/* The ranks move through the window together: per window of chunks, each rank's reads, then
 * each owner's acknowledgements. */
static void *serve(void *arg) {
    shard_t *s = arg;
    double t0 = clock_of(CLOCK_THREAD_CPUTIME_ID);
    uint64_t taken = oc_agg_stats(s->agg)[OC_STAT_contributions];
    uint64_t finished = oc_agg_stats(s->agg)[OC_STAT_reductions];
    uint8_t ack[4 * SLOTS + 64], msg[1024], *batch = malloc(PER_READ * per());
    for (uint32_t base = 0; base < s->total; base += SLOTS) {
        uint32_t end = base + SLOTS < s->total ? base + SLOTS : s->total;
        for (unsigned r = 0; r < s->world; r++) {
            size_t len = 0, in = 0;
            for (uint32_t h = base; h < end; h++) {
                uint32_t o = owner(s, h);
                if (o == r) continue;
                size_t idx = (size_t)h * (s->world - 1) + (r < o ? r : r - 1);
                memcpy(batch + len, s->sealed + idx * per(), per());
                len += per();
                if (++in == PER_READ) {
                    oc_agg_feed(s->agg, batch, len, per(), 0.0);
                    oc_agg_flush(s->agg, discard, NULL);
                    len = in = 0;
                }
            }
            if (len) oc_agg_feed(s->agg, batch, len, per(), 0.0), oc_agg_flush(s->agg, discard, NULL);
        }
        for (unsigned r = 0; r < s->world; r++) {
            size_t m = 0;
            for (uint32_t h = base; h < end; h++)
                if (owner(s, h) == r) memcpy(ack + 4 * m++, &h, 4);
            size_t len = oc_seal_into(&s->ranks[r], msg, sizeof msg, OC_RESULT_ACK, s->seq,
                                      (uint16_t)(OC_AGGREGATOR - s->stripe), (uint32_t)m, ack,
                                      4 * m);
            oc_agg_feed(s->agg, msg, len, len, 0.0);
            oc_agg_flush(s->agg, discard, NULL);
        }
    }
    s->cpu = clock_of(CLOCK_THREAD_CPUTIME_ID) - t0;
    s->taken = oc_agg_stats(s->agg)[OC_STAT_contributions] - taken;
    s->finished = oc_agg_stats(s->agg)[OC_STAT_reductions] == finished + 1;
    free(batch);
    return NULL;
}

static void release(shard_t *s) {
    for (unsigned r = 0; r < s->world; r++) oc_gmac_free(&s->ranks[r].gmac);
    free(s->ranks);
    free(s->sealed);
    oc_agg_free(s->agg);
}

int main(int argc, char **argv) {
    unsigned world = 8, mib = 4, rounds = 5, stripes = 1;
    for (int i = 1; i < argc; i++) {
        sscanf(argv[i], "--world=%u", &world);
        sscanf(argv[i], "--mib=%u", &mib);
        sscanf(argv[i], "--rounds=%u", &rounds);
        sscanf(argv[i], "--shards=%u", &stripes);
    }
    if (world < 2 || world > 255 || stripes < 1 || stripes > 64) {
        fprintf(stderr, "--world=2..255, --shards=1..64\n");
        return 2;
    }
    uint32_t k = (uint32_t)(((size_t)mib << 20) / CHUNK), whole = k * world;
    uint8_t *payload = calloc(1, PREFIX + CHUNK);
    payload[0] = 2; /* float32 */
    payload[1] = 1; /* chunks in groups of 1 */
    payload[2] = (uint8_t)world;
    memcpy(payload + 4, &whole, 4);
    shard_t *shards = calloc(stripes, sizeof *shards);
    pthread_t *threads = calloc(stripes, sizeof *threads);
    double cpu = 0, wall = 0, taken = 0;
    for (unsigned s = 0; s < stripes; s++) {
        shards[s] = (shard_t){.world = world, .stripe = s, .stripes = stripes, .whole = whole};
        start(&shards[s]);
    }
    /* round 0 warms up (its pool is faulted in); rounds 1.. are timed */
    for (unsigned round = 0; round <= rounds; round++) {
        for (unsigned s = 0; s < stripes; s++) prepare(&shards[s], payload, round);
        double t0 = clock_of(CLOCK_MONOTONIC);
        for (unsigned s = 0; s < stripes; s++) pthread_create(&threads[s], NULL, serve, &shards[s]);
        for (unsigned s = 0; s < stripes; s++) pthread_join(threads[s], NULL);
        for (unsigned s = 0; s < stripes; s++) {
            if (!shards[s].finished) {
                fprintf(stderr, "shard %u's reduction did not finish\n", s);
                return 1;
            }
            if (round == 0) continue;
            cpu += shards[s].cpu;
            taken += (double)shards[s].taken;
        }
        if (round > 0) wall += clock_of(CLOCK_MONOTONIC) - t0;
    }
    for (unsigned s = 0; s < stripes; s++) release(&shards[s]);
    oc_gmac g;
    uint8_t tag[16], *datagram = calloc(1, per());
    oc_gmac_init(&g, KEY, 1);
    double t0 = clock_of(CLOCK_PROCESS_CPUTIME_ID);
    for (int i = 0; i < 100000; i++) oc_gmac_tag(&g, 1, (uint64_t)i, datagram, per() - 16, tag);
    double gmac = (clock_of(CLOCK_PROCESS_CPUTIME_ID) - t0) / 100000;
    oc_gmac_free(&g);
    printf("%u ranks, %u MiB each, %u shards, %u rounds: %.3f us of CPU per contribution "
           "(%.0f taken), %.0f contributions per second; GMAC alone %.3f us per %zu-byte "
           "datagram\n", world, mib, stripes, rounds, cpu / taken * 1e6, taken, taken / wall,
           gmac * 1e6, per());
    free(datagram);
    free(payload);
    free(shards);
    free(threads);
    return 0;
}
