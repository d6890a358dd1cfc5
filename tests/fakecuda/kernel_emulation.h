/*
 * What the daemon's CUDA kernel source (hicached/cuda/pages.cu) needs to compile and run as
 * C++ on the CPU, inside the fake driver: the CUDA qualifiers as nothing, the launch indices
 * as thread-locals the emulator sets, uint4 as four 32-bit words, and HC_FRAGMENT as the fake
 * driver's check of each fragment. g++ compiles pages.cu with `-include` of this file; the
 * fake's cuLaunchKernel calls fakecuda_run_pages (defined here, after the kernel is declared).
 *
 * Blocks run one after another, each as min(blockDim, EMU_THREADS) threads one after another:
 * the kernel only strides by gridDim and blockDim and never synchronizes, so every byte lands
 * as it would on a GPU.
 */
#pragma once

#define __global__
#define __device__

#define EMU_THREADS 8u

struct hc_emu_dim3 { unsigned x, y, z; };
static thread_local hc_emu_dim3 blockIdx, blockDim, threadIdx, gridDim;

struct uint4 { unsigned x, y, z, w; };

extern "C" int fakecuda_fragment(const void *dst, long long dst_bytes, const void *src,
                                 long long src_bytes, unsigned thread);
#define HC_FRAGMENT(dst, dst_bytes, src, src_bytes) \
    fakecuda_fragment((dst), (dst_bytes), (src), (src_bytes), threadIdx.x)

extern "C" void hicache_copy_pages(const long long *table, long long lo, long long hi);

extern "C" void fakecuda_run_pages(const long long *table, long long lo, long long hi,
                                   unsigned grid, unsigned block) {
    const unsigned threads = block < EMU_THREADS ? block : EMU_THREADS;
    gridDim = {grid, 1, 1};
    blockDim = {threads, 1, 1};
    for (unsigned b = 0; b < grid; b++) {
        blockIdx = {b, 0, 0};
        for (unsigned t = 0; t < threads; t++) {
            threadIdx = {t, 0, 0};
            hicache_copy_pages(table, lo, hi);
        }
    }
}
