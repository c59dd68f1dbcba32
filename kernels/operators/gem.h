/* operators/gem.h -- generalized-mean (GeM) pooling's operator, in operators.h's place in GeM's programs:
 *
 *   y = (mean over the window of max(x, eps)^p)^(1/p)
 *
 * Only GeM's programs include this header (pool_tuner.operations.OPERATOR_HEADERS), so the programs of
 * the other ops, and the kernel hashes of their tuning records, do not change when GeM does.
 *
 * GeM is an accumulating op: each element enters as max(x, eps)^p (gem_power), the sum of a window
 * is finished as the p-th root of its mean (gem_root), and the gradient of a window's mean reaches
 * each of its inputs divided by the window's area.  p and eps are run-time kernel arguments (a learnt
 * exponent changes every training step, so it must not cost a build): the shared forward kernels and
 * reduction.h's helpers take them as OP_PARAMS and pass them on as OP_ARGS (operators.h), named
 * gem_p and gem_eps there, names that no shared kernel gives a variable of its own.  GeM's own
 * kernels (gem_plane_windows, the input gradient) take them as GEM_PARAMS, named p and eps.
 */
#define OP_SELECTS 0
#define OP_IDENTITY ((acc_t)0)
#define OP_MAP(x) gem_power(x, gem_p, gem_eps)
#define OP_COMBINE(a, b) ((a) + (b))
#define OP_FINISH(value, area) gem_root(value, area, gem_p)
#define OP_GRADIENT_SHARE(grad, area) ((grad) / (acc_t)(area))
#define OP_PARAMS , const acc_t gem_p, const acc_t gem_eps
#define OP_ARGS , gem_p, gem_eps
#define IF_SELECTING(...)

/* Whether output o of an axis of O outputs holds input coordinate x (its forward window, windows.h):
 * always along an axis pooled whole. */
#define WINDOW_HOLDS(x, o, O, START, END) ((O) == 1 || (((x) >= START(o)) & ((x) < END(o))))

/* The inputs and outputs of one plane (the kernels that unroll a whole plane). */
#define PLANE_INPUTS (IN_T * IN_H * IN_W)
#define PLANE_OUTPUTS (OUT_T * OUT_H * OUT_W)

/* Whether the window of output o of a plane holds its input i, each numbered in memory order within
 * its plane: the kernels that unroll a whole plane (gem_plane_windows, gem_plane_gradient) ask it of
 * compile-time constants, so it folds away. */
DEVICE_FN int plane_window_holds(int i, int o)
{
    const int t = i / (IN_H * IN_W), h = i / IN_W % IN_H, w = i % IN_W;
    const int ot = o / (OUT_H * OUT_W), oh = o / OUT_W % OUT_H, ow = o % OUT_W;
    return WINDOW_HOLDS(t, ot, OUT_T, T_WINDOW_START, T_WINDOW_END)
           && WINDOW_HOLDS(h, oh, OUT_H, H_WINDOW_START, H_WINDOW_END)
           && WINDOW_HOLDS(w, ow, OUT_W, W_WINDOW_START, W_WINDOW_END);
}

/* GeM's forward kernels take p and eps after the plane count. */
#define GEM_PARAMS , const acc_t p, const acc_t eps

#if DTYPE_FLOAT16 && defined(__OPENCL_VERSION__)
/* float16 storage in GeM's OpenCL programs: vload_half and vstore_half_rte run as scalar library
 * calls on CPU devices (PoCL), which keeps every loop that calls them from vectorising; these
 * conversions are integer arithmetic and selects, which vectorise, and give the same bits (every
 * float16 value widened exactly; narrowed with round-to-nearest-even, overflow to infinity, NaN a
 * quiet NaN of the same sign). */
DEVICE_FN float float_from_half_bits(unsigned int h)
{
    const unsigned int sign = (h & 0x8000u) << 16, magnitude = h & 0x7FFFu;
    const float normal = UINT_AS_FLOAT((magnitude << 13) + 0x38000000u); /* exponent rebiased by 127 - 15 */
    const float subnormal = (float)magnitude * 0x1p-24f;                  /* exact: magnitude < 2^10 */
    const unsigned int special = 0x7F800000u | ((magnitude & 0x03FFu) << 13); /* infinity, NaN */
    const unsigned int bits = magnitude >= 0x7C00u ? special
                            : magnitude < 0x0400u ? FLOAT_AS_UINT(subnormal) : FLOAT_AS_UINT(normal);
    return UINT_AS_FLOAT(sign | bits);
}

DEVICE_FN ushort half_bits_from_float(float value)
{
    const unsigned int bits = FLOAT_AS_UINT(value), sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7FFFFFFFu;
    /* at least 2^16 (rounds to infinity), infinity or NaN */
    const unsigned int large = magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u;
    /* below 2^-14 (a float16 subnormal or zero): adding 0.5 rounds the value to a multiple of 2^-24,
     * to nearest even, which the low bits of the sum then hold */
    const unsigned int small = FLOAT_AS_UINT(UINT_AS_FLOAT(magnitude) + 0.5f) - 0x3F000000u;
    /* normal: rebias the exponent by 15 - 127, round the 13 dropped mantissa bits to nearest even */
    const unsigned int normal = (magnitude - 0x38000000u + 0x0FFFu + ((magnitude >> 13) & 1u)) >> 13;
    const unsigned int result = magnitude >= 0x47800000u ? large : magnitude < 0x38800000u ? small : normal;
    return (ushort)(sign | result);
}
#undef LOAD
#undef STORE
#define LOAD(ptr, i) float_from_half_bits(((const GLOBAL ushort*)(ptr))[i])
#define STORE(ptr, i, value) (((GLOBAL ushort*)(ptr))[i] = half_bits_from_float(value))
#endif

/* log2 and exp2 in float32 arithmetic alone.  OpenCL's pow, exp2 and log2 run as scalar library
 * calls on CPU devices (PoCL), which keeps every loop that calls them from vectorising; these are
 * plain arithmetic and bit moves, which vectorise.  Accurate to a few float32 ulps for every
 * normal positive x (log2) and every result between 2^-126 and 2^128 (exp2). */
DEVICE_FN float log2_arithmetic(float x)
{
    const unsigned int bits = FLOAT_AS_UINT(x);
    float exponent = (float)((int)(bits >> 23) - 127);
    float m = UINT_AS_FLOAT((bits & 0x007FFFFFu) | 0x3F800000u); /* x = m * 2^exponent, m in [1, 2) */
    const int high = m > 1.41421356f;
    m = high ? 0.5f * m : m;                                     /* m in [0.707, 1.414] */
    exponent += high ? 1.0f : 0.0f;
    const float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;         /* ln m = 2 atanh t, |t| <= 0.172 */
    const float series = t * (2.0f + t2 * (0.666666667f + t2 * (0.4f + t2 * (0.285714286f + t2 * 0.222222222f))));
    return exponent + series * 1.44269504f;
}

DEVICE_FN float exp2_arithmetic(float z)
{
    z = z < -126.0f ? -126.0f : (z > 128.0f ? 128.0f : z);
    const float k = (float)((int)(z + 128.5f) - 128), f = (z - k) * 0.693147181f; /* 2^z = 2^k e^f, |f| <= 0.347 */
    const float e = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666667f + f * (0.0416666667f + f * (0.00833333333f
                    + f * (0.00138888889f + f * 0.000198412698f))))));
    return e * UINT_AS_FLOAT((unsigned int)((int)k + 127) << 23);
}

/* max(x, eps)^p, a NaN staying NaN (as PyTorch's clamp(min=eps) keeps it).  The default exponent 3
 * is two multiplications, as PyTorch's pow computes a power of 3; float32 accumulation takes
 * exp2(p log2 c) in arithmetic (above), float64 the library's pow. */
DEVICE_FN acc_t gem_power(acc_t x, acc_t p, acc_t eps)
{
    const acc_t c = x < eps ? eps : x;
#if DTYPE_FLOAT64
    return p == (acc_t)3 ? c * c * c : pow(c, p);
#else
    return p == (acc_t)3 ? c * c * c : IS_NAN(c) ? c : exp2_arithmetic(p * log2_arithmetic(c));
#endif
}

#if defined(__OPENCL_VERSION__) && !DTYPE_FLOAT64
/* GeM's map on eight contiguous elements at once, in OpenCL's vector types: a work-item that maps a
 * contiguous run (a small plane) does it in vector loads and arithmetic, where PoCL's work-group
 * vectoriser would turn the same scalar code into strided gathers across work-items.  Each helper is
 * its scalar namesake above, expression for expression (compilers contract a * b + c to a fused
 * multiply-add alike in scalar and vector code), so the bits are the scalar map's.  They load and
 * store element by element and never call OpenCL's vload8/vstore8, vload_half8/vstore_half8_rte or
 * min: PoCL does not inline those library calls, and a private array whose address a call takes stays
 * in memory, so a plane kernel that called them ran at half speed.  Eight adjacent loads or stores
 * become one vector access all the same. */
#if DTYPE_FLOAT16 && defined(__F16C__)
/* x86's F16C converts eight float16 values each way in one instruction, with the bits of the integer
 * conversions (round to nearest even; a signalling NaN quieted).  Its builtins take GCC vectors. */
typedef short f16c_halves __attribute__((__vector_size__(16)));
typedef float f16c_floats __attribute__((__vector_size__(32)));

DEVICE_FN float8 widen_half8(ushort8 bits)
{
    union { ushort8 bits; f16c_halves halves; } from;
    union { f16c_floats floats; float8 value; } to;
    from.bits = bits;
    to.floats = __builtin_ia32_vcvtph2ps256(from.halves);
    return to.value;
}

DEVICE_FN ushort8 narrow_half8(float8 value)
{
    union { float8 value; f16c_floats floats; } from;
    union { f16c_halves halves; ushort8 bits; } to;
    from.value = value;
    to.halves = __builtin_ia32_vcvtps2ph256(from.floats, 0); /* 0: round to nearest even */
    return to.bits;
}
#elif DTYPE_FLOAT16
/* The integer conversions, eight at a time. */
DEVICE_FN float8 widen_half8(ushort8 h16)
{
    const uint8 h = convert_uint8(h16);
    const uint8 sign = (h & 0x8000u) << 16, magnitude = h & 0x7FFFu;
    const float8 normal = as_float8((magnitude << 13) + 0x38000000u);
    const float8 subnormal = convert_float8(magnitude) * 0x1p-24f;
    const uint8 special = 0x7F800000u | ((magnitude & 0x03FFu) << 13);
    const uint8 bits = magnitude >= 0x7C00u ? special : magnitude < 0x0400u ? as_uint8(subnormal) : as_uint8(normal);
    return as_float8(sign | bits);
}

DEVICE_FN ushort8 narrow_half8(float8 value)
{
    const uint8 bits = as_uint8(value), sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7FFFFFFFu;
    const uint8 large = magnitude > 0x7F800000u ? (uint8)0x7E00u : (uint8)0x7C00u;
    const uint8 small = as_uint8(as_float8(magnitude) + 0.5f) - 0x3F000000u;
    const uint8 normal = (magnitude - 0x38000000u + 0x0FFFu + ((magnitude >> 13) & 1u)) >> 13;
    const uint8 result = magnitude >= 0x47800000u ? large : magnitude < 0x38800000u ? small : normal;
    return convert_ushort8(sign | result);
}
#endif

DEVICE_FN float8 load8(const GLOBAL scalar_t* RESTRICT in, index_t offset)
{
#if DTYPE_FLOAT16 || DTYPE_BFLOAT16
    const GLOBAL ushort* at = (const GLOBAL ushort*)in + offset;
    const ushort8 bits = (ushort8)(at[0], at[1], at[2], at[3], at[4], at[5], at[6], at[7]);
#if DTYPE_FLOAT16
    return widen_half8(bits);
#else
    return as_float8(convert_uint8(bits) << 16);
#endif
#else
    const GLOBAL float* at = in + offset;
    return (float8)(at[0], at[1], at[2], at[3], at[4], at[5], at[6], at[7]);
#endif
}

/* sum + v.s0 + v.s1 + ... + v.s7, added one after the other: eight scalar lanes' partial sums in
 * their order. */
DEVICE_FN float add_in_order8(float sum, float8 v)
{
    return sum + v.s0 + v.s1 + v.s2 + v.s3 + v.s4 + v.s5 + v.s6 + v.s7;
}

/* The first input of eight-input step `step` over a plane (the kernels that unroll one): 8 * step,
 * but a last step that would run past the plane's end ends at its end instead (a ternary: min is a
 * call). */
DEVICE_FN int plane_step_start(int step)
{
    return 8 * step < PLANE_INPUTS - 8 ? 8 * step : PLANE_INPUTS - 8;
}

/* Eight floats from private memory, and into it: vload8 and vstore8 of private memory are calls
 * on PoCL, which keep the arrays they touch in memory. */
DEVICE_FN float8 private_load8(const __private float* from)
{
    return (float8)(from[0], from[1], from[2], from[3], from[4], from[5], from[6], from[7]);
}

DEVICE_FN void private_store8(float8 value, __private float* to)
{
    to[0] = value.s0, to[1] = value.s1, to[2] = value.s2, to[3] = value.s3;
    to[4] = value.s4, to[5] = value.s5, to[6] = value.s6, to[7] = value.s7;
}

DEVICE_FN float8 log2_arithmetic8(float8 x)
{
    const uint8 bits = as_uint8(x);
    float8 exponent = convert_float8(as_int8(bits >> 23) - 127);
    float8 m = as_float8((bits & 0x007FFFFFu) | 0x3F800000u);
    const int8 high = m > 1.41421356f;
    m = high ? 0.5f * m : m;
    exponent += high ? (float8)1.0f : (float8)0.0f;
    const float8 t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
    const float8 series = t * (2.0f + t2 * (0.666666667f + t2 * (0.4f + t2 * (0.285714286f + t2 * 0.222222222f))));
    return exponent + series * 1.44269504f;
}

DEVICE_FN float8 exp2_arithmetic8(float8 z)
{
    z = z < -126.0f ? (float8)-126.0f : (z > 128.0f ? (float8)128.0f : z);
    const float8 k = convert_float8(convert_int8(z + 128.5f) - 128), f = (z - k) * 0.693147181f;
    const float8 e = 1.0f + f * (1.0f + f * (0.5f + f * (0.166666667f + f * (0.0416666667f + f * (0.00833333333f
                     + f * (0.00138888889f + f * 0.000198412698f))))));
    return e * as_float8(as_uint8(convert_int8(k) + 127) << 23);
}

DEVICE_FN float8 gem_power8(float8 x, float p, float eps)
{
    const float8 c = x < eps ? (float8)eps : x;
    if (p == 3.0f)
        return c * c * c;
    return IS_NAN(c) ? c : exp2_arithmetic8(p * log2_arithmetic8(c));
}

/* Eight results in the storage's bits, each as STORE narrows one (float16: half_bits_from_float;
 * bfloat16: prelude.h's bfloat16_from_float), to be stored as stored_t. */
#if DTYPE_FLOAT16
typedef ushort stored_t;
typedef ushort8 stored8_t;
DEVICE_FN ushort8 stored8(float8 value)
{
    return narrow_half8(value);
}
#elif DTYPE_BFLOAT16
typedef ushort stored_t;
typedef ushort8 stored8_t;
DEVICE_FN ushort8 stored8(float8 value)
{
    const uint8 bits = as_uint8(value);
    return convert_ushort8(IS_NAN(value) ? (bits >> 16) | 0x0040u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
#else
typedef float stored_t;
typedef float8 stored8_t;
DEVICE_FN float8 stored8(float8 value)
{
    return value;
}
#endif

/* value[k], narrowed to the storage type, into memory offset offset + k of out, k = 0..7 (element by
 * element: vstore8 is a call on PoCL). */
DEVICE_FN void store8(GLOBAL scalar_t* RESTRICT out, index_t offset, float8 value)
{
    const stored8_t narrowed = stored8(value);
    GLOBAL stored_t* at = (GLOBAL stored_t*)out + offset;
    at[0] = narrowed.s0, at[1] = narrowed.s1, at[2] = narrowed.s2, at[3] = narrowed.s3;
    at[4] = narrowed.s4, at[5] = narrowed.s5, at[6] = narrowed.s6, at[7] = narrowed.s7;
}

/* gem_root of eight windows at once, every lane's root taken and then kept or not. */
DEVICE_FN float8 gem_root8(float8 sums, float8 areas, float p)
{
    const float8 mean = sums / areas;
    const float8 root = exp2_arithmetic8(log2_arithmetic8(mean) / p);
    return (IS_NAN(mean) | (mean == INFINITY)) ? mean : root;
}

/* gem_log of eight clamped elements at once, its bits: the backward's terms of p over a plane in
 * vector steps (kernels/operators/gem_plane_gradient.c). */
DEVICE_FN float8 gem_log8(float8 c)
{
    return IS_NAN(c) ? c : 0.693147181f * log2_arithmetic8(c);
}
#define GEM_VECTORS 1 /* the eight-wide helpers above exist */
#else
#define GEM_VECTORS 0
#endif

/* ln(c) of a clamped element c (> 0, or NaN): the gradient of p needs it. */
DEVICE_FN acc_t gem_log(acc_t c)
{
#if DTYPE_FLOAT64
    return log(c);
#else
    return IS_NAN(c) ? c : 0.693147181f * log2_arithmetic(c);
#endif
}

/* The output of a window whose mapped elements sum to `sum` over `area` elements. */
DEVICE_FN acc_t gem_root(acc_t sum, index_t area, acc_t p)
{
    const acc_t mean = sum / (acc_t)area;
#if DTYPE_FLOAT64
    return pow(mean, (acc_t)1 / p);
#else
    return IS_NAN(mean) || mean == (acc_t)INFINITY ? mean : exp2_arithmetic(log2_arithmetic(mean) / p);
#endif
}
