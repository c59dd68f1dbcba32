/* prelude.h -- the only place where CUDA and OpenCL C differ.
 *
 * Every kernel template is written once against these macros and compiled both ways:
 * PyOpenCL compiles it as OpenCL C (where __OPENCL_VERSION__ is defined), PyCUDA/nvcc as CUDA.
 * The host prepends `#define`s for the data type (DTYPE_*), the index width (INDEX_64),
 * the problem shape and the tuning parameters.
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
#define DEVICE_FN static __device__ __forceinline__
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

/* ---------------------------------------------------------------- data types
 * scalar_t is the storage type, acc_t the accumulation type; LOAD/STORE convert between them. */
#if DTYPE_FLOAT64
typedef double scalar_t;
typedef double acc_t;
#elif DTYPE_FLOAT32
typedef float scalar_t;
typedef float acc_t;
#else
#error "pool_tuner: no DTYPE_* define given"
#endif
#define LOAD(ptr, i) ((acc_t)(ptr)[i])
#define STORE(ptr, i, value) ((ptr)[i] = (scalar_t)(value))
