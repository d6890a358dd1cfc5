/* What the reuse policy's native tables share (queues.c, shadows.c): mix(), murmur3's 32-bit
 * finalizer (a table's home slot, and the last step of a key's sampled id: keep it as
 * reuse_lru.PyShadows.key_id computes it), pow2_at_least(), a table's size, and
 * fills_hole(), the rule of backward-shift deletion every open-addressing table here uses. */
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

/* Backward-shift deletion in a table with linear probing: after slot `hole` is emptied, the
 * deleter walks j = hole+1, hole+2, ... (cyclically) up to the first empty slot, and moves
 * the entry at j into the hole (j becoming the hole) when that keeps its probe chain unbroken:
 * when its home slot does not lie cyclically in (hole, j]. So no lookup ever meets an empty
 * slot before its key, and no tombstones are needed. */
static inline int fills_hole(uint32_t hole, uint32_t j, uint32_t home) {
    return (hole <= j) ? (home <= hole || home > j) : (home <= hole && home > j);
}

#endif
