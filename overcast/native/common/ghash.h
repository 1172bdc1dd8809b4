/* AES-128-GMAC (GCM's tag over associated data alone, a 96-bit nonce) on x86-64's AES-NI and
 * 256-bit carry-less multiplies (VPCLMULQDQ): sixteen blocks of GHASH per reduction, two per
 * multiply. OpenSSL's EVP path takes about twice as long per 9 KB datagram, most of it in its
 * 128-bit GHASH, plus a lookup of parameters by name per message. wire.c uses this where the
 * CPU has the instructions (oc_fast_gmac_usable) and OpenSSL otherwise; tests check the two
 * agree on every length and split.
 *
 * Memory: an oc_fast_gmac holds the expanded key and the hash key's powers, nothing else; the
 * caller owns it (any alignment) and wipes it when done. Nothing keeps a pointer to the caller's
 * data past a call. Thread-safe: a key is only read once made. */
#ifndef OVERCAST_NATIVE_GHASH_H
#define OVERCAST_NATIVE_GHASH_H

#include <stddef.h>
#include <stdint.h>

/* Blocks hashed per reduction. */
#define OC_GHASH_STRIDE 16

typedef struct {
    uint8_t powers[OC_GHASH_STRIDE][16]; /* H^16 .. H^1, byte-reversed as the multiplies take them */
    uint8_t halves[OC_GHASH_STRIDE][16]; /* each power's two halves added, for Karatsuba */
    uint8_t round_keys[11][16];   /* AES-128's */
} oc_fast_gmac;

/* 1 if this CPU has AES-NI, PCLMULQDQ, AVX2 and VPCLMULQDQ (checked once). */
int oc_fast_gmac_usable(void);
/* Only where oc_fast_gmac_usable() says so. */
void oc_fast_gmac_init(oc_fast_gmac *k, const uint8_t key[16]);
/* GCM's tag under (key, iv) over `n` pieces laid end to end as associated data, no ciphertext. */
void oc_fast_gmac_tag(const oc_fast_gmac *k, const uint8_t iv[12], const uint8_t *const *data,
                      const size_t *len, int n, uint8_t tag[16]);

#endif
