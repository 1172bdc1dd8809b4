/* The wire, natively: the 36-byte header every overcast message starts with, AES-GMAC sealing
 * and opening through OpenSSL 3's EVP, and the per-sender replay window. The same format as
 * overcast/wire (Python): a message sealed by either side opens in the other.
 *
 * Layout (little-endian): magic "OC", version u8, kind u8, job u32, comm u32, seq u32, src u16,
 * dst u16, chunk u32, length u32, counter u64; then `length` payload bytes; then a 16-byte tag,
 * AES-128-GCM over an empty plaintext with header and payload as associated data, under the
 * nonce (src u16, 0 u16, counter u64).
 *
 * Ownership: nothing here keeps a pointer to a caller's buffer past the call. An oc_gmac owns
 * its EVP context (one per key and direction, the key set once); an oc_replay owns its words. */
#ifndef OVERCAST_NATIVE_WIRE_H
#define OVERCAST_NATIVE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define OC_HEADER_BYTES 36
#define OC_TAG_BYTES 16
#define OC_OVERHEAD_BYTES (OC_HEADER_BYTES + OC_TAG_BYTES)
#define OC_MAX_PAYLOAD (1u << 26)
#define OC_MAX_DATAGRAM 65507u
#define OC_VERSION 2
#define OC_KEY_BYTES 16
#define OC_AGGREGATOR 0xFFFEu
/* In-network reduction may be striped over several aggregator endpoints (the shards of one or
 * more aggregators): endpoint e sends as OC_AGGREGATOR - e and is addressed so, so every
 * endpoint has a nonce space of its own under the communicator key. Ranks are below them all. */
#define OC_MAX_STRIPES 256u
#define OC_MAX_WORLD (OC_AGGREGATOR + 1 - OC_MAX_STRIPES)
/* What a datagram carrying `payload` bytes occupies on an Ethernet link: IP, UDP, Ethernet. */
#define OC_LINK_BYTES(payload) ((double)(payload) + OC_OVERHEAD_BYTES + 20 + 8 + 14)
#define OC_ANY 0xFFFFu

enum oc_kind {
    OC_HELLO = 1, OC_DESCRIBE = 2, OC_ABORT = 3, OC_GOODBYE = 4, OC_REFUSE = 5,
    OC_FAILOVER = 6, OC_REJOIN = 7, OC_RING_DATA = 10, OC_A2A_DATA = 11, OC_A2A_PULL = 12,
    OC_MCAST_DATA = 20,
    OC_REPAIR_REQUEST = 21, OC_REPAIR_DATA = 22, OC_ACTIVATE = 23, OC_FIN = 24,
    OC_MCAST_END = 25, OC_CONTRIB = 30, OC_RESULT = 31, OC_RESULT_ACK = 32, OC_CREDIT = 33,
    OC_WITHDRAW = 34, OC_P2P_OFFER = 40, OC_P2P_ACCEPT = 41, OC_P2P_REFUSE = 42,
    OC_P2P_DATA = 43,
};

/* Why an authentic message did not fit its receiver's state (the drop counters' names). */
enum { OC_FIT = 0, OC_MISFIT_OUT_OF_RANGE, OC_MISFIT_WRONG_LENGTH, OC_MISFIT_MALFORMED,
       OC_MISFIT_WRONG_SENDER };

typedef struct {
    uint8_t kind;
    uint32_t job, comm, seq;
    uint16_t src, dst;
    uint32_t chunk, length;
    uint64_t counter;
} oc_header;

/* The endpoint (stripe) a source id names, or -1 for none of `stripes`. */
static inline int oc_endpoint_of(uint16_t src, uint32_t stripes) {
    uint32_t e = (uint32_t)OC_AGGREGATOR - src;
    return src <= OC_AGGREGATOR && e < stripes ? (int)e : -1;
}

int oc_kind_known(unsigned kind);
/* 0 if `len` bytes hold a header of this version with a known kind and a payload length within
 * OC_MAX_PAYLOAD; -1 (nothing written) otherwise. */
int oc_header_parse(const uint8_t *buf, size_t len, oc_header *out);
void oc_header_write(uint8_t *buf, const oc_header *h);

/* One key, one direction, the key set up once; per message only the nonce, the associated data
 * and the tag. On a CPU with AES-NI and VPCLMULQDQ the tag is ghash.h's; elsewhere, or with
 * OVERCAST_GMAC=openssl in the environment when the key is set (a check of the other path),
 * OpenSSL 3's EVP, the cipher fetched once per process. Both give GCM's tag. */
typedef struct {
    void *ctx;  /* EVP_CIPHER_CTX, or NULL */
    void *fast; /* oc_fast_gmac, or NULL */
    int sealing;
} oc_gmac;

int oc_gmac_init(oc_gmac *g, const uint8_t key[OC_KEY_BYTES], int sealing);
static inline int oc_gmac_keyed(const oc_gmac *g) { return g->ctx || g->fast; }
void oc_gmac_free(oc_gmac *g);
/* The tag of `len` bytes under (src, counter): 0 on success. */
int oc_gmac_tag(oc_gmac *g, uint16_t src, uint64_t counter, const uint8_t *data, size_t len,
                uint8_t tag[OC_TAG_BYTES]);
/* 1 if `tag` is the tag of `len` bytes under (src, counter), else 0. */
int oc_gmac_check(oc_gmac *g, uint16_t src, uint64_t counter, const uint8_t *data, size_t len,
                  const uint8_t tag[OC_TAG_BYTES]);

/* The sender's side of one communicator key: its identity and its message counter (never
 * repeated under the key: it is the nonce). */
typedef struct {
    oc_gmac gmac;
    uint32_t job, comm;
    uint16_t src;
    uint64_t counter;
} oc_sealer;

/* Write header, payload and tag at buf[0..]; `cap` bytes available. Returns the message's
 * length, or 0 (nothing written, no counter spent) if it does not fit or is too large, or if the
 * counter has reached UINT64_MAX (the key is spent). */
size_t oc_seal_into(oc_sealer *s, uint8_t *buf, size_t cap, uint8_t kind, uint32_t seq,
                    uint16_t dst, uint32_t chunk, const uint8_t *payload, size_t len);

/* The same with the payload in two parts laid one after the other (either may be empty). */
size_t oc_seal_parts(oc_sealer *s, uint8_t *buf, size_t cap, uint8_t kind, uint32_t seq,
                     uint16_t dst, uint32_t chunk, const uint8_t *head, size_t head_len,
                     const uint8_t *body, size_t body_len);

/* The same message for a payload sent from where it lies (a stream's gather write): only the
 * header, at out[0..OC_HEADER_BYTES), and the tag after it are written; the tag covers the header
 * and both parts as they are now, so they must not change until they are sent. 0, or -1 (nothing
 * written, no counter spent) if the payload is too large or the key is spent. */
int oc_seal_detached(oc_sealer *s, uint8_t out[OC_OVERHEAD_BYTES], uint8_t kind, uint32_t seq,
                     uint16_t dst, uint32_t chunk, const uint8_t *head, size_t head_len,
                     const uint8_t *body, size_t body_len);

/* Each counter accepted at most once, none `width` or more below the highest accepted (RFC
 * 6479's ring of 64-bit words; width 0: strictly increasing). */
typedef struct {
    uint64_t top;
    int any;          /* whether anything was accepted (top is meaningless before) */
    uint32_t width;
    uint32_t nwords;
    uint64_t *words;  /* owned */
} oc_replay;

/* 0, or -1 if its words could not be allocated (then left with nwords 0, as before init). */
int oc_replay_init(oc_replay *w, uint32_t width);
/* The bytes oc_replay_init allocates for a window of `width`. */
size_t oc_replay_bytes(uint32_t width);
void oc_replay_free(oc_replay *w);
int oc_replay_accept(oc_replay *w, uint64_t counter);

#endif
