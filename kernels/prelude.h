/* prelude.h -- the only place where CUDA and OpenCL C differ.
 *
 * Every kernel template is written once against these macros and compiled both ways:
 * PyOpenCL compiles it as OpenCL C (where __OPENCL_VERSION__ is defined), PyCUDA/nvcc as CUDA.
 * The host prepends `#define`s for the data type (DTYPE_*), the index width (INDEX_64),
 * the per-sample shape and the tuning parameters; the plane count arrives at run time (below).
 */

#ifdef __OPENCL_VERSION__
/* ---------------------------------------------------------------- OpenCL C */
#define KERNEL __kernel
#define DEVICE_FN static inline
#define GLOBAL __global
#define LOCAL_MEM __local
#define RESTRICT restrict
#define GROUP_ID ((long)get_group_id(0))
#define LOCAL_ID_X ((int)get_local_id(0))
#define LOCAL_ID_Y ((int)get_local_id(1))
#define BARRIER() barrier(CLK_LOCAL_MEM_FENCE)
typedef long int64_t_;
#if DTYPE_FLOAT64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

#else
/* ---------------------------------------------------------------- CUDA */
#define KERNEL extern "C" __global__
/* `unused`: a helper that one variant does not call must not trip nvcc's #177 warning
 * (compile-check builds with --Werror all-warnings). */
#define DEVICE_FN static __device__ __forceinline__ __attribute__((unused))
#define GLOBAL
#define LOCAL_MEM __shared__
#define RESTRICT __restrict__
#define GROUP_ID ((long long)blockIdx.x)
#define LOCAL_ID_X ((int)threadIdx.x)
#define LOCAL_ID_Y ((int)threadIdx.y)
#define BARRIER() __syncthreads()
typedef long long int64_t_;
#endif

/* ---------------------------------------------------------------- index width
 * INDEX_64 is chosen per launch by the host: 32-bit only when every element offset and every
 * window product (o * I) provably fits in a signed 32-bit int. */
#if INDEX_64
typedef int64_t_ index_t;
#else
typedef int index_t;
#endif

/* ---------------------------------------------------------------- the plane count
 * The number of planes (batch x channels) is the last argument of every kernel, after its buffers,
 * so that one built program serves every batch size of a per-sample shape.  It is 64-bit on both
 * sides of the launch (the host passes a numpy int64); kernel bodies name it N_PLANES, in the index
 * type: INDEX_64 is 0 only when every element count, and so the plane count, fits 32 bits. */
#ifdef __OPENCL_VERSION__
#define PLANES_PARAM , const long n_planes
#else
#define PLANES_PARAM , const long long n_planes
#endif
#define N_PLANES ((index_t)n_planes)

/* ---------------------------------------------------------------- bits and NaN */
#ifdef __OPENCL_VERSION__
#define FLOAT_AS_UINT(x) as_uint(x)
#define UINT_AS_FLOAT(x) as_float(x)
/* x != x is true exactly for NaN (no fast-math flags are ever passed); PoCL compiles isnan() as an
 * out-of-line call, which keeps its loops from vectorising. */
#define IS_NAN(x) ((x) != (x))
#else
#include <cuda_fp16.h>
#define FLOAT_AS_UINT(x) __float_as_uint(x)
#define UINT_AS_FLOAT(x) __uint_as_float(x)
#define IS_NAN(x) isnan(x)
#endif

/* ---------------------------------------------------------------- data types
 * scalar_t is the storage type, acc_t the accumulation type; LOAD/STORE convert between them.
 * float16 and bfloat16 are stored as such and accumulated in float32; neither needs an optional
 * OpenCL extension (vload_half/vstore_half are core, bfloat16 is bit shifts on ushort). */
#if DTYPE_FLOAT64
typedef double scalar_t;
typedef double acc_t;
#define LOAD(ptr, i) ((ptr)[i])
#define STORE(ptr, i, value) ((ptr)[i] = (value))

#elif DTYPE_FLOAT32
typedef float scalar_t;
typedef float acc_t;
#define LOAD(ptr, i) ((ptr)[i])
#define STORE(ptr, i, value) ((ptr)[i] = (value))

#elif DTYPE_FLOAT16
typedef float acc_t;
#ifdef __OPENCL_VERSION__
typedef half scalar_t;
#define LOAD(ptr, i) vload_half((i), (ptr))
#define STORE(ptr, i, value) vstore_half_rte((value), (i), (ptr))
#else
typedef __half scalar_t;
#define LOAD(ptr, i) __half2float((ptr)[i])
#define STORE(ptr, i, value) ((ptr)[i] = __float2half_rn(value))
#endif

#elif DTYPE_BFLOAT16
typedef unsigned short scalar_t;
typedef float acc_t;
/* bfloat16 is the top half of a float32: widen by a shift, narrow with round-to-nearest-even
 * (NaN kept a quiet NaN of the same sign). */
DEVICE_FN unsigned short bfloat16_from_float(float value)
{
    const unsigned int bits = FLOAT_AS_UINT(value);
    if (IS_NAN(value))
        return (unsigned short)((bits >> 16) | 0x0040u);
    return (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#define LOAD(ptr, i) UINT_AS_FLOAT(((unsigned int)(ptr)[i]) << 16)
#define STORE(ptr, i, value) ((ptr)[i] = bfloat16_from_float(value))

#else
#error "pool_tuner: no DTYPE_* define given"
#endif
