/*
 * What this machine's memory allows for rows in random places: the ceiling of a page_size 1
 * copy, without the engine. Copies `rows` rows of `row` bytes between two prefaulted regions
 * (transparent huge pages advised, as the pools'), four ways, each timed `reps` times (median):
 *
 *   seq       one contiguous copy of the same bytes (the engine's baseline);
 *   random    every row from a random place to a random place (a page_size 1 batch);
 *   prefetch  the same rows, the next row's source prefetched while one is copied (what the
 *             engine's kernel does);
 *
 * with glibc's memcpy, or with non-temporal stores when `nt` is 1 (the engine streams copies of
 * 32 MiB and more). Prints one line of GB/s: seq random prefetch.
 *
 * Usage: rows ROWS ROW_BYTES NT REPS
 */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static char *region(size_t n) {
    char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 1, n);
    return p;
}

static void copy(char *d, const char *s, size_t n, int nt) {
    if (!nt) {
        memcpy(d, s, n);
        return;
    }
    for (size_t o = 0; o < n; o += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + o));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + o + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + o + 48));
        _mm_stream_si128((__m128i *)(d + o), a);
        _mm_stream_si128((__m128i *)(d + o + 16), b);
        _mm_stream_si128((__m128i *)(d + o + 32), c);
        _mm_stream_si128((__m128i *)(d + o + 48), e);
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: rows ROWS ROW_BYTES NT REPS\n");
        return 2;
    }
    size_t rows = strtoul(argv[1], NULL, 10), row = strtoul(argv[2], NULL, 10);
    int nt = atoi(argv[3]), reps = atoi(argv[4]);
    if (rows == 0 || row == 0 || row % 64 || reps < 1) return 2;
    size_t places = rows * 4; /* rows land in a region four times the batch, as a pool's */
    char *src = region(places * row), *dst = region(places * row);
    size_t *sp = malloc(rows * sizeof *sp), *dp = malloc(rows * sizeof *dp);
    double *t[3];
    for (int k = 0; k < 3; k++) t[k] = malloc((size_t)reps * sizeof(double));
    srand(1);
    for (size_t i = 0; i < rows; i++) {
        sp[i] = ((size_t)rand() * (RAND_MAX + 1UL) + (size_t)rand()) % places;
        dp[i] = ((size_t)rand() * (RAND_MAX + 1UL) + (size_t)rand()) % places;
    }
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        copy(dst, src, rows * row, nt);
        _mm_sfence();
        double t1 = now();
        for (size_t i = 0; i < rows; i++) copy(dst + dp[i] * row, src + sp[i] * row, row, nt);
        _mm_sfence();
        double t2 = now();
        for (size_t i = 0; i < rows; i++) {
            if (i + 1 < rows)
                for (size_t o = 0; o < row && o < 4096; o += 64)
                    __builtin_prefetch(src + sp[i + 1] * row + o, 0, 3);
            copy(dst + dp[i] * row, src + sp[i] * row, row, nt);
        }
        _mm_sfence();
        double t3 = now();
        t[0][r] = t1 - t0;
        t[1][r] = t2 - t1;
        t[2][r] = t3 - t2;
    }
    double gb = (double)(rows * row) / 1e9;
    for (int k = 0; k < 3; k++) qsort(t[k], (size_t)reps, sizeof(double), cmp);
    printf("%.3f %.3f %.3f\n", gb / t[0][reps / 2], gb / t[1][reps / 2], gb / t[2][reps / 2]);
    return 0;
}
