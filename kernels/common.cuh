// common.cuh: what every workbench kernel shares: element types, math in the accumulation
// type, and a block-wide sum.
//
// The kernels are compiled by NVRTC: through CuPy's RawModule on a GPU, and through
// cuda-python's NVRTC bindings in the CPU-side compile check (tests/test_kernels_compile.py).
// So this header includes nothing. fp16 and bf16 values travel as their 16-bit patterns and
// are converted by single PTX instructions (cvt), which keeps the sources free of the CUDA
// toolkit's headers. cvt to bf16 needs sm_80 or newer; on sm_75 (T4, the oldest architecture
// CUDA 13's NVRTC compiles for, and the one we target) the bf16 store rounds the bits itself.
//
// All arithmetic happens in the accumulation type: float for fp16, bf16 and fp32 storage,
// double for fp64 storage (which exists so that torch.autograd.gradcheck can test the kernels).
#pragma once

struct half16 { unsigned short bits; };    // IEEE 754 binary16
struct bfloat16 { unsigned short bits; };  // the top 16 bits of a float32

// Element<T>: load T into its accumulation type, and round an accumulator back into T.
template <typename T> struct Element;

template <> struct Element<double> {
    typedef double acc;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};

template <> struct Element<float> {
    typedef float acc;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};

template <> struct Element<half16> {
    typedef float acc;
    static __device__ __forceinline__ float load(half16 v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
        return f;
    }
    static __device__ __forceinline__ half16 store(float f) {
        half16 v;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v.bits) : "f"(f));  // round to nearest even
        return v;
    }
};

template <> struct Element<bfloat16> {
    typedef float acc;
    static __device__ __forceinline__ float load(bfloat16 v) {
        return __int_as_float(static_cast<int>(v.bits) << 16);  // exact: bf16 is a truncated float
    }
    static __device__ __forceinline__ bfloat16 store(float f) {
        bfloat16 v;
#if __CUDA_ARCH__ >= 800
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v.bits) : "f"(f));  // round to nearest even
#else
        // sm_75 (T4) has no bf16 cvt: the same rounding on the bits. A NaN keeps its sign and
        // stays a (quiet) NaN; any other value rounds to nearest, ties to even, as cvt.rn does.
        const unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            v.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);
        } else {
            v.bits = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
#endif
        return v;
    }
};

// Math overloads, so one template body serves float and double accumulators.
__device__ __forceinline__ float wb_erf(float x) { return erff(x); }
__device__ __forceinline__ double wb_erf(double x) { return erf(x); }
__device__ __forceinline__ float wb_exp(float x) { return expf(x); }
__device__ __forceinline__ double wb_exp(double x) { return exp(x); }
__device__ __forceinline__ float wb_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double wb_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float wb_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double wb_rsqrt(double x) { return rsqrt(x); }

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// The sum of v over the whole block, returned to every thread. blockDim.x must be a multiple
// of 32 (the launchers guarantee it) and every thread of the block must call it.
// `scratch` holds 32 accumulators in shared memory.
template <typename A> __device__ A block_sum(A v, A* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous call's readers of scratch[0] are done
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        v = warp_sum(lane < warps ? scratch[lane] : A(0));
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    return scratch[0];
}

// The dtypes every kernel is instantiated for; the Python side picks the entry point by suffix
// (bias_gelu_forward_bf16 and so on).
#define WB_FOR_EACH_DTYPE(INSTANTIATE) \
    INSTANTIATE(f64, double)           \
    INSTANTIATE(f32, float)            \
    INSTANTIATE(f16, half16)           \
    INSTANTIATE(bf16, bfloat16)
