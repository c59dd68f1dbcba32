/* bandwidth.cl -- the benchmark's memory streams (pool_tuner/bench.py), OpenCL C only.
 *
 * A suite shape's bandwidth floor is its bytes over the fastest copy the device makes; on CPU
 * devices a kernel spread over every compute unit copies faster than clEnqueueCopyBuffer (PoCL
 * copies a buffer on one thread).  read and write time the two directions alone, which the
 * forward (read-mostly) and backward (write-mostly) passes approach.
 *
 * copy_streaming stores past the caches (clang's non-temporal store): a CPU then writes each
 * destination line without first reading it, as a plain store must.  Where the compiler lacks the
 * builtin it is a plain store, the same kernel as copy. */

#if defined(__has_builtin)
#if __has_builtin(__builtin_nontemporal_store)
#define STORE_PAST_CACHES(pointer, value) __builtin_nontemporal_store((value), (pointer))
#endif
#endif
#ifndef STORE_PAST_CACHES
#define STORE_PAST_CACHES(pointer, value) (*(pointer) = (value))
#endif

/* Neighbouring work-items copy neighbouring elements (vectorised across work-items on CPUs). */
__kernel void copy(__global const float* restrict src, __global float* restrict dst)
{
    const size_t i = get_global_id(0);
    dst[i] = src[i];
}

__kernel void copy_streaming(__global const float* restrict src, __global float* restrict dst)
{
    const size_t i = get_global_id(0);
    STORE_PAST_CACHES(&dst[i], src[i]);
}

/* Work-item i sums elements [READ_RUN * i, READ_RUN * (i + 1)) by vector loads of 8 (the form
 * that read fastest on PoCL, as fast as the suite's read-mostly kernels); the host defines
 * READ_RUN, a multiple of 8. */
__kernel void read(__global const float* restrict src, __global float* restrict sums)
{
    const size_t i = get_global_id(0);
    float8 run = vload8(i * (READ_RUN / 8), src);
    for (int k = 1; k < READ_RUN / 8; ++k)
        run += vload8(i * (READ_RUN / 8) + k, src);
    const float4 four = run.lo + run.hi;
    sums[i] = four.x + four.y + four.z + four.w;
}

__kernel void write(__global float* restrict dst, float value)
{
    dst[get_global_id(0)] = value;
}
