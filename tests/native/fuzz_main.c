/* A driver for the fuzz targets where libFuzzer is not at hand (gcc): runs a target on
 * -runs=N inputs, each random or a mutation of one before it (bytes changed, inserted, cut,
 * or two inputs spliced), from -seed=S, and on any files named. A crash or a sanitizer report
 * ends the run; otherwise it prints the inputs run. tools/fuzz runs the same targets under
 * libFuzzer, coverage-guided. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint64_t state;
static uint64_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

enum { KEEP = 64, MAX_INPUT = 4096 };

int main(int argc, char **argv) {
    unsigned long long runs = 100000, seed = 1;
    int files = 0;
    for (int i = 1; i < argc; i++) {
        if (sscanf(argv[i], "-runs=%llu", &runs) == 1 || sscanf(argv[i], "-seed=%llu", &seed) == 1)
            continue;
        FILE *f = fopen(argv[i], "rb");
        if (f == NULL) {
            perror(argv[i]);
            return 2;
        }
        static uint8_t buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        LLVMFuzzerTestOneInput(buf, n);
        files++;
    }
    state = seed * 0x9E3779B97F4A7C15ull + 1;
    static uint8_t pool[KEEP][MAX_INPUT], input[MAX_INPUT];
    static size_t sizes[KEEP];
    for (unsigned long long run = 0; run < runs; run++) {
        size_t n;
        uint64_t how = next() % 8;
        if (run < KEEP || how == 0) { /* fresh: random bytes of a random length */
            n = next() % (how == 0 ? MAX_INPUT : 600);
            for (size_t i = 0; i < n; i++) input[i] = (uint8_t)next();
        } else { /* a mutation of a kept input */
            size_t from = next() % KEEP;
            n = sizes[from];
            memcpy(input, pool[from], n);
            int edits = 1 + (int)(next() % 8);
            for (int e = 0; e < edits; e++) {
                uint64_t what = next() % 4;
                if (what == 0 && n) input[next() % n] = (uint8_t)next();
                else if (what == 1 && n) input[next() % n] ^= (uint8_t)(1u << next() % 8);
                else if (what == 2 && n < MAX_INPUT) { /* insert a byte */
                    size_t at = next() % (n + 1);
                    memmove(input + at + 1, input + at, n - at);
                    input[at] = (uint8_t)next();
                    n++;
                } else if (n) { /* cut, or splice in another input's tail */
                    size_t at = next() % n, other = next() % KEEP;
                    size_t tail = sizes[other] > at ? sizes[other] - at : 0;
                    if (next() % 2 && tail) {
                        memcpy(input + at, pool[other] + at, tail);
                        n = at + tail;
                    } else {
                        n = at;
                    }
                }
            }
        }
        LLVMFuzzerTestOneInput(input, n);
        size_t keep = run < KEEP ? run : next() % KEEP;
        memcpy(pool[keep], input, n);
        sizes[keep] = n;
    }
    printf("%llu inputs run, %d files\n", runs, files);
    return 0;
}
