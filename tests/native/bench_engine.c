/* The aggregator's engine alone, without sockets: P ranks' contributions to one reduction
 * (float32, `--mib` MiB per rank, 8,920-byte chunks as on 9000-byte MTU links), sealed
 * beforehand, fed as reads of up to 7 datagrams (what one GRO read holds), each rank's
 * results acknowledged in batches, the outbox sealed after every read. Prints the CPU per
 * contribution taken, and what GMAC alone costs per datagram of that size. tools/bench_core
 * builds and runs it. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "aggregator.h"

/* an 8,980-byte datagram, as a 9,000-byte MTU carries: header, prefix, data, tag */
enum { PREFIX = 12, CHUNK = 8980 - OC_OVERHEAD_BYTES - PREFIX, PER_READ = 7 };
static const uint8_t KEY[16] = {42};

static double cpu(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void discard(void *ctx, int h, uint16_t dst, const uint8_t *d, size_t n, size_t seg) {
    (void)ctx, (void)h, (void)dst, (void)d, (void)n, (void)seg;
}

int main(int argc, char **argv) {
    unsigned world = 8, mib = 4, rounds = 5;
    for (int i = 1; i < argc; i++) {
        sscanf(argv[i], "--world=%u", &world);
        sscanf(argv[i], "--mib=%u", &mib);
        sscanf(argv[i], "--rounds=%u", &rounds);
    }
    uint32_t k = (uint32_t)(((size_t)mib << 20) / CHUNK), total = k * world, slots = 128;
    /* every contribution of every rank, sealed once, in the order each rank sends */
    size_t per = OC_OVERHEAD_BYTES + PREFIX + CHUNK, count = (size_t)total * (world - 1);
    uint8_t *sealed = malloc(count * per);
    oc_sealer *ranks = calloc(world, sizeof *ranks);
    uint8_t *payload = calloc(1, PREFIX + CHUNK);
    payload[0] = 2; /* float32 */
    payload[1] = 1;
    payload[2] = (uint8_t)world;
    memcpy(payload + 4, &total, 4);
    payload[10] = 1; /* one stripe */
    double gmac = 0, taken = 0, elapsed = 0;
    for (unsigned round = 0; round < rounds; round++) {
        oc_agg *a = oc_agg_new(slots);
        uint32_t granted;
        int h = oc_agg_register(a, 1, 1, world, 0, 0, OC_MAX_DATAGRAM, KEY, 0, &granted);
        for (unsigned r = 0; r < world; r++) {
            ranks[r] = (oc_sealer){.job = 1, .comm = 1, .src = (uint16_t)r};
            oc_gmac_init(&ranks[r].gmac, KEY, 1);
        }
        /* rank r's j-th contribution at sealed + (r * total + j) * per, in window order */
        size_t n = 0;
        for (uint32_t g = 0; g < total; g++)
            for (unsigned r = 0; r < world; r++) {
                if (g % world == r) continue;
                oc_seal_into(&ranks[r], sealed + n++ * per, per, OC_CONTRIB, 0, OC_AGGREGATOR, g,
                             payload, PREFIX + CHUNK);
            }
        double t0 = cpu();
        /* the ranks move through the window together: per window of chunks, each rank's reads */
        uint8_t ack[4 * 128 + 64], msg[1024];
        for (uint32_t base = 0; base < total; base += slots) {
            uint32_t end = base + slots < total ? base + slots : total;
            for (unsigned r = 0; r < world; r++) {
                uint8_t batch[PER_READ * 9100];
                size_t len = 0, in = 0;
                for (uint32_t g = base; g < end; g++) {
                    if (g % world == r) continue;
                    size_t idx = (size_t)g * (world - 1) + (r < g % world ? r : r - 1);
                    memcpy(batch + len, sealed + idx * per, per);
                    len += per;
                    if (++in == PER_READ) {
                        oc_agg_feed(a, batch, len, per, 0.0);
                        oc_agg_flush(a, discard, NULL);
                        len = in = 0;
                    }
                }
                if (len) oc_agg_feed(a, batch, len, per, 0.0), oc_agg_flush(a, discard, NULL);
            }
            for (unsigned r = 0; r < world; r++) { /* each owner acknowledges its results */
                size_t m = 0;
                for (uint32_t g = base; g < end; g++)
                    if (g % world == r) memcpy(ack + 4 * m++, &g, 4);
                size_t len = oc_seal_into(&ranks[r], msg, sizeof msg, OC_RESULT_ACK, 0,
                                          OC_AGGREGATOR, (uint32_t)m, ack, 4 * m);
                oc_agg_feed(a, msg, len, len, 0.0);
                oc_agg_flush(a, discard, NULL);
            }
        }
        elapsed += cpu() - t0;
        taken += (double)oc_agg_stats(a)[OC_STAT_contributions];
        if (oc_agg_stats(a)[OC_STAT_reductions] != 1) {
            fprintf(stderr, "the reduction did not finish\n");
            return 1;
        }
        (void)h;
        for (unsigned r = 0; r < world; r++) oc_gmac_free(&ranks[r].gmac);
        oc_agg_free(a);
    }
    oc_gmac g;
    uint8_t tag[16];
    oc_gmac_init(&g, KEY, 1);
    double t0 = cpu();
    for (int i = 0; i < 100000; i++) oc_gmac_tag(&g, 1, (uint64_t)i, sealed, per - 16, tag);
    gmac = (cpu() - t0) / 100000;
    oc_gmac_free(&g);
    printf("%u ranks, %u MiB each, %u rounds: %.3f us of CPU per contribution "
           "(%.0f taken); GMAC alone %.3f us per %zu-byte datagram\n",
           world, mib, rounds, elapsed / taken * 1e6, taken, gmac * 1e6, per);
    free(sealed);
    free(ranks);
    free(payload);
    return 0;
}
