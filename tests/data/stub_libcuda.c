/* A stand-in for libcuda with the symbols pool_tuner's driver-API launch path calls, for checking
 * through a real C ABI (no GPU) how ctypes passes their arguments.  Launches are recorded, not run:
 * the test reads `last_launch`, `pushes` and `sets` back through ctypes.  Contexts: a stack per thread. */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

struct launch {
    void *function;
    unsigned grid[3], block[3], shared;
    void *stream;
    uint64_t pointers[4];
    void *context;
    void *extra;
};

struct launch last_launch;
int pushes, pops, sets;
static __thread void *stack[8];
static __thread int depth;

int cuInit(unsigned flags) { return 0; }
int cuGetErrorName(int status, const char **name) { *name = "CUDA_ERROR_STUB"; return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **context, int device) { *context = (void *)(uintptr_t)(0xC0000000C0ull + device); return 0; }
int cuCtxGetCurrent(void **context) { *context = depth ? stack[depth - 1] : 0; return 0; }
int cuCtxPushCurrent_v2(void *context) { ++pushes; stack[depth++] = context; return 0; }
int cuCtxPopCurrent_v2(void **context) { if (!depth) return 201; ++pops; *context = stack[--depth]; return 0; }
int cuCtxSetCurrent(void *context)
{
    ++sets;
    if (!context) { if (depth) --depth; }
    else if (depth) stack[depth - 1] = context;
    else stack[depth++] = context;
    return 0;
}
int cuCtxGetDevice(int *device)
{
    if (!depth) return 201;
    *device = (int)((uintptr_t)stack[depth - 1] & 0xF);
    return 0;
}
int cuCtxSynchronize(void) { return depth ? 0 : 201; }
int cuMemAlloc_v2(uint64_t *pointer, size_t nbytes) { if (!depth) return 201; *pointer = 0xD000000000ull; return 0; }
int cuMemFree_v2(uint64_t pointer) { return depth ? 0 : 201; }
int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t nbytes) { return depth ? 0 : 201; }
int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t nbytes) { return depth ? 0 : 201; }
int cuModuleLoadData(void **module, const void *image) { if (!depth) return 201; *module = (void *)image; return 0; }
int cuModuleGetFunction(void **function, void *module, const char *name) { *function = (void *)0xF00Dull; return 0; }
int cuFuncGetAttribute(int *value, int attribute, void *function) { *value = 1024; return 0; }
int cuPointerGetAttribute(void *data, int attribute, uint64_t pointer) { return 1; }
int cuStreamSynchronize(void *stream) { return 0; }
int cuStreamIsCapturing(void *stream, int *status) { *status = 0; return 0; }
int cuStreamWaitEvent(void *stream, void *event, unsigned flags) { return 0; }
int cuEventCreate(void **event, unsigned flags) { *event = (void *)0xE0E0ull; return 0; }
int cuEventRecord(void *event, void *stream) { return 0; }
int cuEventSynchronize(void *event) { return 0; }
int cuEventElapsedTime(float *ms, void *start, void *end) { *ms = 0.5f; return 0; }
int cuEventDestroy_v2(void *event) { return 0; }
int cuMemsetD8Async(uint64_t dst, unsigned char value, size_t count, void *stream) { return 0; }
int cuMemsetD16Async(uint64_t dst, unsigned short value, size_t count, void *stream) { return 0; }
int cuMemsetD32Async(uint64_t dst, unsigned value, size_t count, void *stream) { return 0; }
int cuMemsetD2D32Async(uint64_t dst, size_t pitch, unsigned value, size_t width, size_t height, void *stream)
{ return 0; }
int cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t nbytes, void *stream) { return 0; }

/* Reads as many 64-bit arguments (device pointers, then the plane count) as the test says the
 * kernel takes (`n_pointers`).  Refused with no context current, as the driver refuses it. */
int n_pointers;
int cuLaunchKernel(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **params, void **extra)
{
    if (!depth) return 201;
    memset(&last_launch, 0, sizeof last_launch);
    last_launch.function = function;
    last_launch.grid[0] = gx; last_launch.grid[1] = gy; last_launch.grid[2] = gz;
    last_launch.block[0] = bx; last_launch.block[1] = by; last_launch.block[2] = bz;
    last_launch.shared = shared;
    last_launch.stream = stream;
    for (int i = 0; i < n_pointers && i < 4; ++i)
        last_launch.pointers[i] = *(uint64_t *)params[i];
    last_launch.context = depth ? stack[depth - 1] : 0;
    last_launch.extra = extra;
    return 0;
}
