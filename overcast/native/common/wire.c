#include "wire.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>

#include "bytes.h"
#include "ghash.h"

int oc_kind_known(unsigned kind) {
    switch (kind) {
    case OC_HELLO: case OC_DESCRIBE: case OC_ABORT: case OC_GOODBYE: case OC_REFUSE:
    case OC_FAILOVER: case OC_REJOIN: case OC_RING_DATA: case OC_A2A_DATA: case OC_A2A_PULL:
    case OC_MCAST_DATA:
    case OC_REPAIR_REQUEST: case OC_REPAIR_DATA: case OC_ACTIVATE: case OC_FIN:
    case OC_MCAST_END: case OC_CONTRIB: case OC_RESULT: case OC_RESULT_ACK: case OC_CREDIT:
    case OC_WITHDRAW: case OC_P2P_OFFER: case OC_P2P_ACCEPT: case OC_P2P_REFUSE:
    case OC_P2P_DATA:
        return 1;
    default:
        return 0;
    }
}

int oc_header_parse(const uint8_t *b, size_t len, oc_header *h) {
    if (len < OC_HEADER_BYTES || b[0] != 'O' || b[1] != 'C' || b[2] != OC_VERSION ||
        !oc_kind_known(b[3]))
        return -1;
    uint32_t length = oc_get32(b + 24);
    if (length > OC_MAX_PAYLOAD) return -1;
    h->kind = b[3];
    h->job = oc_get32(b + 4);
    h->comm = oc_get32(b + 8);
    h->seq = oc_get32(b + 12);
    h->src = oc_get16(b + 16);
    h->dst = oc_get16(b + 18);
    h->chunk = oc_get32(b + 20);
    h->length = length;
    h->counter = oc_get64(b + 28);
    return 0;
}

void oc_header_write(uint8_t *b, const oc_header *h) {
    b[0] = 'O';
    b[1] = 'C';
    b[2] = OC_VERSION;
    b[3] = h->kind;
    oc_put32(b + 4, h->job);
    oc_put32(b + 8, h->comm);
    oc_put32(b + 12, h->seq);
    oc_put16(b + 16, h->src);
    oc_put16(b + 18, h->dst);
    oc_put32(b + 20, h->chunk);
    oc_put32(b + 24, h->length);
    oc_put64(b + 28, h->counter);
}

/* Fetched once (implicit fetches by name on every init are OpenSSL 3's slow path); never freed:
 * it lives as long as the process. */
static EVP_CIPHER *cipher;
static void fetch_cipher(void) { cipher = EVP_CIPHER_fetch(NULL, "AES-128-GCM", NULL); }
static EVP_CIPHER *aes_gcm(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT; /* planes of several threads may be first */
    pthread_once(&once, fetch_cipher);
    return cipher;
}

/* An OpenSSL call failed: its errors are left on this thread's queue, where the next caller of
 * OpenSSL (Python's ssl and hashlib too) would find them as its own. */
static int evp_failed(void) {
    ERR_clear_error();
    return -1;
}

static int fast_gmac_chosen(void) {
    const char *choice = getenv("OVERCAST_GMAC");
    return oc_fast_gmac_usable() && !(choice && strcmp(choice, "openssl") == 0);
}

int oc_gmac_init(oc_gmac *g, const uint8_t key[OC_KEY_BYTES], int sealing) {
    g->ctx = NULL;
    g->fast = NULL;
    g->sealing = sealing;
    if (fast_gmac_chosen()) {
        if ((g->fast = malloc(sizeof(oc_fast_gmac))) == NULL) return -1;
        oc_fast_gmac_init(g->fast, key);
        return 0;
    }
    EVP_CIPHER *gcm = aes_gcm();
    if (gcm == NULL) return evp_failed();
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    if (ctx == NULL) return evp_failed();
    int ok = sealing ? EVP_EncryptInit_ex2(ctx, gcm, key, NULL, NULL)
                     : EVP_DecryptInit_ex2(ctx, gcm, key, NULL, NULL);
    if (ok != 1) {
        EVP_CIPHER_CTX_free(ctx);
        return evp_failed();
    }
    g->ctx = ctx;
    return 0;
}

void oc_gmac_free(oc_gmac *g) {
    EVP_CIPHER_CTX_free(g->ctx);
    g->ctx = NULL;
    if (g->fast) OPENSSL_cleanse(g->fast, sizeof(oc_fast_gmac));
    free(g->fast);
    g->fast = NULL;
}

static void nonce(uint8_t iv[12], uint16_t src, uint64_t counter) {
    oc_put16(iv, src);
    oc_put16(iv + 2, 0);
    oc_put64(iv + 4, counter);
}

/* EVP takes int lengths: messages are at most OC_MAX_PAYLOAD + overhead, far below INT_MAX. The
 * tag is over the pieces laid end to end (GCM takes associated data in parts). */
static int gmac_tag_pieces(oc_gmac *g, uint16_t src, uint64_t counter, const uint8_t *const *data,
                           const size_t *len, int n, uint8_t tag[OC_TAG_BYTES]) {
    EVP_CIPHER_CTX *ctx = g->ctx;
    uint8_t iv[12], none[16];
    int out;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (len[i] > OC_MAX_PAYLOAD + OC_HEADER_BYTES - total) return -1;
        total += len[i];
    }
    if (!g->sealing) return -1;
    nonce(iv, src, counter);
    if (g->fast) {
        oc_fast_gmac_tag(g->fast, iv, data, len, n, tag);
        return 0;
    }
    if (EVP_EncryptInit_ex2(ctx, NULL, NULL, iv, NULL) != 1) return evp_failed();
    for (int i = 0; i < n; i++)
        if (len[i] && EVP_EncryptUpdate(ctx, NULL, &out, data[i], (int)len[i]) != 1)
            return evp_failed();
    if (EVP_EncryptFinal_ex(ctx, none, &out) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, OC_TAG_BYTES, tag) != 1)
        return evp_failed();
    return 0;
}

int oc_gmac_tag(oc_gmac *g, uint16_t src, uint64_t counter, const uint8_t *data, size_t len,
                uint8_t tag[OC_TAG_BYTES]) {
    return gmac_tag_pieces(g, src, counter, &data, &len, 1, tag);
}

int oc_gmac_check(oc_gmac *g, uint16_t src, uint64_t counter, const uint8_t *data, size_t len,
                  const uint8_t tag[OC_TAG_BYTES]) {
    EVP_CIPHER_CTX *ctx = g->ctx;
    uint8_t iv[12], none[16], expected[OC_TAG_BYTES];
    int n;
    if (g->sealing || len > OC_MAX_PAYLOAD + OC_HEADER_BYTES) return 0;
    nonce(iv, src, counter);
    if (g->fast) {
        oc_fast_gmac_tag(g->fast, iv, &data, &len, 1, expected);
        return CRYPTO_memcmp(expected, tag, OC_TAG_BYTES) == 0;
    }
    memcpy(expected, tag, OC_TAG_BYTES); /* SET_TAG takes a non-const pointer */
    if (EVP_DecryptInit_ex2(ctx, NULL, NULL, iv, NULL) != 1 ||
        EVP_DecryptUpdate(ctx, NULL, &n, data, (int)len) != 1 ||
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, OC_TAG_BYTES, expected) != 1 ||
        EVP_DecryptFinal_ex(ctx, none, &n) != 1) {
        ERR_clear_error(); /* a tag that does not match, or a failure: not authentic */
        return 0;
    }
    return 1;
}

static int payload_fits(size_t head_len, size_t body_len) {
    return head_len <= OC_MAX_PAYLOAD && body_len <= OC_MAX_PAYLOAD - head_len;
}

/* Write the header of the sealer's next message at out; its counter (spent once sealed). */
static uint64_t next_header(const oc_sealer *s, uint8_t *out, uint8_t kind, uint32_t seq,
                            uint16_t dst, uint32_t chunk, size_t len) {
    oc_header h = {kind, s->job, s->comm, seq, s->src, dst, chunk, (uint32_t)len, s->counter + 1};
    oc_header_write(out, &h);
    return h.counter;
}

size_t oc_seal_parts(oc_sealer *s, uint8_t *buf, size_t cap, uint8_t kind, uint32_t seq,
                     uint16_t dst, uint32_t chunk, const uint8_t *head, size_t head_len,
                     const uint8_t *body, size_t body_len) {
    if (!payload_fits(head_len, body_len) || cap < OC_OVERHEAD_BYTES ||
        head_len + body_len > cap - OC_OVERHEAD_BYTES)
        return 0;
    size_t len = head_len + body_len;
    if (s->counter == UINT64_MAX) return 0; /* a counter never repeats under one key */
    uint64_t counter = next_header(s, buf, kind, seq, dst, chunk, len);
    if (head_len) memcpy(buf + OC_HEADER_BYTES, head, head_len);
    if (body_len) memcpy(buf + OC_HEADER_BYTES + head_len, body, body_len);
    if (oc_gmac_tag(&s->gmac, s->src, counter, buf, OC_HEADER_BYTES + len,
                    buf + OC_HEADER_BYTES + len) != 0)
        return 0;
    s->counter = counter;
    return OC_OVERHEAD_BYTES + len;
}

size_t oc_seal_into(oc_sealer *s, uint8_t *buf, size_t cap, uint8_t kind, uint32_t seq,
                    uint16_t dst, uint32_t chunk, const uint8_t *payload, size_t len) {
    return oc_seal_parts(s, buf, cap, kind, seq, dst, chunk, NULL, 0, payload, len);
}

int oc_seal_detached(oc_sealer *s, uint8_t out[OC_OVERHEAD_BYTES], uint8_t kind, uint32_t seq,
                     uint16_t dst, uint32_t chunk, const uint8_t *head, size_t head_len,
                     const uint8_t *body, size_t body_len) {
    if (!payload_fits(head_len, body_len) || s->counter == UINT64_MAX) return -1;
    uint64_t counter = next_header(s, out, kind, seq, dst, chunk, head_len + body_len);
    const uint8_t *data[3] = {out, head, body};
    size_t lens[3] = {OC_HEADER_BYTES, head_len, body_len};
    if (gmac_tag_pieces(&s->gmac, s->src, counter, data, lens, 3, out + OC_HEADER_BYTES) != 0)
        return -1;
    s->counter = counter;
    return 0;
}

size_t oc_replay_bytes(uint32_t width) {
    return (width ? (width - 1) / 64 + 2 : 0) * sizeof(uint64_t);
}

int oc_replay_init(oc_replay *w, uint32_t width) {
    w->top = 0;
    w->any = 0;
    w->width = width;
    w->nwords = (uint32_t)(oc_replay_bytes(width) / sizeof(uint64_t));
    w->words = w->nwords ? calloc(w->nwords, sizeof(uint64_t)) : NULL;
    if (w->nwords && w->words == NULL) {
        w->nwords = 0; /* uninitialised, so the next datagram tries again */
        return -1;
    }
    return 0;
}

void oc_replay_free(oc_replay *w) {
    free(w->words);
    w->words = NULL;
    w->nwords = 0;
}

int oc_replay_accept(oc_replay *w, uint64_t counter) {
    if (!w->any || counter > w->top) {
        if (w->nwords) {
            uint64_t word = counter >> 6, from = w->any ? (w->top >> 6) + 1 : word;
            if (w->any && word - (w->top >> 6) >= w->nwords)
                memset(w->words, 0, w->nwords * sizeof(uint64_t));
            else
                for (uint64_t i = from; i <= word; i++) w->words[i % w->nwords] = 0;
            w->words[word % w->nwords] |= (uint64_t)1 << (counter & 63);
        }
        w->top = counter;
        w->any = 1;
        return 1;
    }
    if (w->top - counter >= w->width) return 0;
    uint64_t *word = &w->words[(counter >> 6) % w->nwords];
    uint64_t bit = (uint64_t)1 << (counter & 63);
    if (*word & bit) return 0;
    *word |= bit;
    return 1;
}
