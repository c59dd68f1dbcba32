/* gpu.h -- the prelude of the variants shaped for GPUs alone: where CUDA and OpenCL C differ for them.
 *
 * prelude.h is where CUDA and OpenCL C differ for every program; this header adds what only the
 * GPU-only variants (Variant.device_types == ("gpu",)) use -- exchanging partial results within a
 * warp, and loading several neighbouring elements as one vector -- and only their programs include
 * it (kernel_source.GPU_VARIANTS), after reduction.h.  A CPU record's kernel hash covers the
 * variants legal on CPUs alone, so this file is no part of it: editing it stales no CPU record.
 */

/* ---------------------------------------------------------------- warp exchange
 * WARP_WIDTH work-items of neighbouring local ids run as one warp (CUDA's 32 lanes).
 * warp_shuffle_down(r, distance, ...) gives every work-item the partial result of the work-item
 * `distance` lanes after it in its warp, or its own where that lane is past the warp's end -- the
 * semantics of CUDA's __shfl_down_sync.  Every work-item of the work-group must call it (CUDA: the
 * whole warp takes part; OpenCL: it holds barriers).
 *
 * CUDA exchanges in registers.  OpenCL C exchanges through the local-memory slots `values` and
 * `positions` (one per work-item) with the same semantics: OpenCL's sub-groups have an
 * implementation-defined size and mapping of work-items, and the devices here (PoCL, Oclgrind)
 * offer none, so there the warp rounds of a reduction are local-memory rounds that follow CUDA's
 * lanes exactly -- which is how the CUDA path's lane arithmetic runs and is tested off GPUs. */
#define WARP_WIDTH 32

#ifdef __OPENCL_VERSION__
DEVICE_FN reduction_t warp_shuffle_down(reduction_t r, int distance, LOCAL_MEM acc_t* values
                                        IF_SELECTING(, LOCAL_MEM index_t* positions))
{
    const int lane = LOCAL_ID_X % WARP_WIDTH;
    const int source = lane + distance < WARP_WIDTH ? LOCAL_ID_X + distance : LOCAL_ID_X;
    STORE_PARTIAL(values[LOCAL_ID_X], positions[LOCAL_ID_X], r);
    BARRIER();
    const reduction_t other = PARTIAL(values[source], positions[source]);
    BARRIER();
    return other;
}
#else
/* (CUDA: shared memory is a place, not a pointer's type.) */
DEVICE_FN reduction_t warp_shuffle_down(reduction_t r, int distance, acc_t* values IF_SELECTING(, index_t* positions))
{
    (void)values;
    IF_SELECTING((void)positions;)
    r.value = __shfl_down_sync(0xffffffffu, r.value, distance);
    IF_SELECTING(r.position = __shfl_down_sync(0xffffffffu, r.position, distance);)
    return r;
}
#endif

/* ---------------------------------------------------------------- vector loads
 * load_vector(in, vector_index, x) reads the vector_width elements vector_width * vector_index ...
 * of `in` with one load and widens them to acc_t in x[0 .. vector_width - 1].  CUDA's wide loads
 * need an address aligned to the vector's size; vectors_aligned(in) says whether `in` is (the same
 * answer for every work-item, so branching on it is uniform).  OpenCL's vload needs only the
 * element's alignment, but takes the same test so that both read the same elements the same way. */
#if vector_width > 1
#define VECTOR_BYTES (vector_width * sizeof(scalar_t))

#ifdef __OPENCL_VERSION__
#define PASTE_(a, b) a##b
#define PASTE(a, b) PASTE_(a, b)
/* What one vload gives (LOADED_VECTOR) and one of its components as acc_t (WIDEN). */
#if DTYPE_FLOAT16
#define LOADED_VECTOR PASTE(float, vector_width)
#define VLOAD(i, p) PASTE(vload_half, vector_width)(i, p)
#define WIDEN(component) (component)
#elif DTYPE_BFLOAT16
#define LOADED_VECTOR PASTE(ushort, vector_width)
#define VLOAD(i, p) PASTE(vload, vector_width)(i, p)
#define WIDEN(component) UINT_AS_FLOAT(((unsigned int)(component)) << 16)
#elif DTYPE_FLOAT64
#define LOADED_VECTOR PASTE(double, vector_width)
#define VLOAD(i, p) PASTE(vload, vector_width)(i, p)
#define WIDEN(component) (component)
#else
#define LOADED_VECTOR PASTE(float, vector_width)
#define VLOAD(i, p) PASTE(vload, vector_width)(i, p)
#define WIDEN(component) (component)
#endif

DEVICE_FN int vectors_aligned(const GLOBAL scalar_t* in)
{
    return (size_t)in % VECTOR_BYTES == 0;
}

DEVICE_FN void load_vector(const GLOBAL scalar_t* RESTRICT in, index_t vector_index, acc_t* x)
{
    const LOADED_VECTOR v = VLOAD(vector_index, in);
    x[0] = WIDEN(v.s0);
    x[1] = WIDEN(v.s1);
#if vector_width == 4
    x[2] = WIDEN(v.s2);
    x[3] = WIDEN(v.s3);
#endif
}

#else
typedef struct __align__(VECTOR_BYTES) {
    scalar_t element[vector_width];
} vector_t;

DEVICE_FN int vectors_aligned(const GLOBAL scalar_t* in)
{
    return (unsigned long long)in % VECTOR_BYTES == 0;
}

DEVICE_FN void load_vector(const GLOBAL scalar_t* RESTRICT in, index_t vector_index, acc_t* x)
{
    const vector_t v = ((const GLOBAL vector_t*)in)[vector_index];
#pragma unroll
    for (int k = 0; k < vector_width; ++k)
        x[k] = LOAD(v.element, k);
}
#endif
#endif
