/* What the reuse policy's native tables share (queues.c, shadows.c): mix(), murmur3's 32-bit
 * finalizer (a table's home slot, and the last step of a key's sampled id: keep it as
 * reuse_lru.PyShadows.key_id computes it), and pow2_at_least(), a table's size. */
#ifndef HICACHED_CACHE_HASHING_H
#define HICACHED_CACHE_HASHING_H

#include <stdint.h>

static inline uint32_t mix(uint32_t x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

/* the least power of two, at least 16, not below n */
static inline uint32_t pow2_at_least(uint64_t n) {
    uint32_t p = 16;
    while ((uint64_t)p < n) p <<= 1;
    return p;
}

#endif
