/* bandwidth.cu -- the benchmark's memory streams (pool_tuner/bench.py) on CUDA devices: the same
 * four kernels, with the same arguments and work per thread, as bandwidth.cl.
 *
 * copy_streaming stores with __stcs (the "evict first" streaming store), the counterpart of the
 * OpenCL version's non-temporal store; read sums READ_RUN elements per thread by float4 loads
 * (the host defines READ_RUN, a multiple of 8). */

#define GLOBAL_ID ((size_t)blockIdx.x * blockDim.x + threadIdx.x)

extern "C" __global__ void copy(const float* __restrict__ src, float* __restrict__ dst)
{
    const size_t i = GLOBAL_ID;
    dst[i] = src[i];
}

extern "C" __global__ void copy_streaming(const float* __restrict__ src, float* __restrict__ dst)
{
    const size_t i = GLOBAL_ID;
    __stcs(&dst[i], src[i]);
}

extern "C" __global__ void read(const float* __restrict__ src, float* __restrict__ sums)
{
    const size_t i = GLOBAL_ID;
    const float4* runs = reinterpret_cast<const float4*>(src) + i * (READ_RUN / 4);
    float4 run = runs[0];
    for (int k = 1; k < READ_RUN / 4; ++k) {
        const float4 next = runs[k];
        run.x += next.x;
        run.y += next.y;
        run.z += next.z;
        run.w += next.w;
    }
    sums[i] = (run.x + run.y) + (run.z + run.w);
}

extern "C" __global__ void write(float* __restrict__ dst, float value)
{
    dst[GLOBAL_ID] = value;
}
