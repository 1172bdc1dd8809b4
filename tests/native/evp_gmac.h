/* The oracle the native tests check ghash.h's tags against: GCM's tag over `len` bytes of
 * associated data, no ciphertext, through OpenSSL's EVP with a context made for the message.
 * All zeros if OpenSSL fails, which no tag of ghash.h's matches by chance. */
#ifndef OVERCAST_TESTS_EVP_GMAC_H
#define OVERCAST_TESTS_EVP_GMAC_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <openssl/evp.h>

static inline void evp_gmac(const uint8_t key[16], const uint8_t iv[12], const uint8_t *data,
                            size_t len, uint8_t tag[16]) {
    EVP_CIPHER_CTX *c = EVP_CIPHER_CTX_new();
    int out;
    uint8_t none[16];
    int ok = c && EVP_EncryptInit_ex2(c, EVP_aes_128_gcm(), key, iv, NULL) == 1 &&
             (len == 0 || EVP_EncryptUpdate(c, NULL, &out, data, (int)len) == 1) &&
             EVP_EncryptFinal_ex(c, none, &out) == 1 &&
             EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, 16, tag) == 1;
    if (!ok) memset(tag, 0, 16);
    EVP_CIPHER_CTX_free(c);
}

#endif
