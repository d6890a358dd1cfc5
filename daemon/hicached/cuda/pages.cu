/*
 * hicached's page copy kernel: every page of a batch, every layer of a range, one launch.
 *
 * Compiled at run time with NVRTC (hicached.cuda.kernels), loaded and launched through the
 * driver. The host pool is page-locked and mapped into the device's address space, so the
 * kernel reads and writes host pages directly: one launch moves what the DMA path needs one
 * copy per page, layer and component for (SM copies over PCIe; no copy engine, no per-copy
 * driver call).
 *
 * The launch table (hicached.cuda.launch builds it; int64 words, in page-locked mapped
 * memory the device reads):
 *
 *   word 0  magic HC_TABLE_MAGIC       word 1  plans    word 2  pages per plan
 *   word 3  reserved
 *   then per plan HC_PLAN_WORDS words:
 *     dst bases, src bases (word offsets into the table of one address per layer),
 *     dst pages, src pages (word offsets of `pages` page ids), layers of the plan,
 *     unit bytes, units per page, dst page pitch, src page pitch, dst unit stride,
 *     src unit stride, reserved
 *
 * Page `i` of plan `p` at layer `l` is `units` rows of `unit bytes`; row r lies at
 * base[l] + page * pitch + r * stride on each side (hicached.copy.plan.CopyPlan, the same
 * addressing the CPU runner and the DMA path use). A launch covers layers [lo, hi) of the
 * plans (a plan with fewer layers skips the rest): fragment f of the launch is page
 * f % pages of plan (f / pages) % plans at layer lo + f / (pages * plans). Blocks take
 * fragments grid-stride; a block's threads copy a fragment 16 bytes at a time where both
 * sides are 16-byte aligned (KV rows are), else byte by byte.
 *
 * The same source runs on the CPU in the tests' fake driver (tests/fakecuda): it uses only
 * blockIdx, blockDim, threadIdx and gridDim, no shared memory and no synchronisation, and
 * HC_FRAGMENT (true here) lets the fake check each fragment's extent on both sides and skip
 * one it refuses.
 */

#define HC_TABLE_MAGIC 0x3150434843LL /* "HCP1" */
#define HC_HEADER_WORDS 4
#define HC_PLAN_WORDS 12

#ifndef HC_FRAGMENT
#define HC_FRAGMENT(dst, dst_bytes, src, src_bytes) ((void)(dst_bytes), (void)(src_bytes), 1)
#endif

typedef long long hc_i64;
typedef unsigned long long hc_u64;

__device__ static void hc_copy_rows(char *dst, const char *src, hc_i64 width, hc_i64 rows,
                                    hc_i64 dst_stride, hc_i64 src_stride) {
    const hc_u64 align = (hc_u64)dst | (hc_u64)src | (hc_u64)width | (hc_u64)dst_stride
                         | (hc_u64)src_stride;
    if ((align & 15) == 0) {
        const hc_i64 per_row = width >> 4;
        if (rows == 1) {
            for (hc_i64 k = threadIdx.x; k < per_row; k += blockDim.x)
                ((uint4 *)dst)[k] = ((const uint4 *)src)[k];
            return;
        }
        const hc_i64 n = per_row * rows;
        for (hc_i64 k = threadIdx.x; k < n; k += blockDim.x) {
            const hc_i64 r = k / per_row, c = k - r * per_row;
            ((uint4 *)(dst + r * dst_stride))[c] = ((const uint4 *)(src + r * src_stride))[c];
        }
        return;
    }
    const hc_i64 n = width * rows;
    for (hc_i64 k = threadIdx.x; k < n; k += blockDim.x) {
        const hc_i64 r = k / width, c = k - r * width;
        dst[r * dst_stride + c] = src[r * src_stride + c];
    }
}

extern "C" __global__ void hicache_copy_pages(const hc_i64 *table, hc_i64 lo, hc_i64 hi) {
    const hc_i64 plans = table[1], pages = table[2];
    const hc_i64 total = (hi - lo) * plans * pages;
    for (hc_i64 f = blockIdx.x; f < total; f += gridDim.x) {
        const hc_i64 page = f % pages, t = f / pages;
        const hc_i64 *plan = table + HC_HEADER_WORDS + (t % plans) * HC_PLAN_WORDS;
        const hc_i64 layer = lo + t / plans;
        if (layer >= plan[4]) continue;
        const hc_i64 unit_bytes = plan[5], units = plan[6];
        const hc_i64 dst_stride = plan[9], src_stride = plan[10];
        char *dst = (char *)(table[plan[0] + layer] + table[plan[2] + page] * plan[7]);
        const char *src = (const char *)(table[plan[1] + layer] + table[plan[3] + page] * plan[8]);
        const hc_i64 extent_dst = (units - 1) * dst_stride + unit_bytes;
        const hc_i64 extent_src = (units - 1) * src_stride + unit_bytes;
        if (!HC_FRAGMENT(dst, extent_dst, src, extent_src)) continue;
        if (dst_stride == unit_bytes && src_stride == unit_bytes)
            hc_copy_rows(dst, src, unit_bytes * units, 1, 0, 0);
        else
            hc_copy_rows(dst, src, unit_bytes, units, dst_stride, src_stride);
    }
}
