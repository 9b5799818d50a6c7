// residual_dropout_layer_norm.cu: h = residual + dropout(x); y = LayerNorm(h), forward and
// backward, over the last dimension of a contiguous (rows, cols) matrix.
//
// Why fuse: this is the seam between the sublayers of a transformer block. Unfused it is
// three kernels (dropout, add, layer_norm), and dropout also writes a mask that backward reads
// again. Here one kernel reads x and residual once and writes h (the new residual stream) and
// y. The dropout mask is never stored: it is a hash of (seed, element index), so backward
// regenerates it from the same seed, the trick FlashAttention uses for its dropout.
//
// With no residual and p = 0 it is a plain LayerNorm (h is then x itself and is not written).
// The statistics are computed in two passes over the row (mean, then the mean of squared
// deviations), which is as accurate as Welford's method here because the row is re-read from
// the L1/L2 cache, not recomputed. mean and rstd (1 / sqrt(var + eps)) are saved per row for
// backward, in the accumulation type, like torch's native layer_norm.
#include "common.cuh"

// splitmix64's finaliser: a strong 64-bit mix, so neighbouring indices give unrelated bits.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// True when element `index` survives dropout with drop probability p: a uniform number in
// [0, 1) from the top 24 bits of the hash, compared with p.
__device__ __forceinline__ bool keep(unsigned long long seed, long long index, float p) {
    const unsigned long long bits = mix64(seed + 0x9E3779B97F4A7C15ull * (unsigned long long)(index + 1));
    return (float)(bits >> 40) * (1.0f / 16777216.0f) >= p;
}

// One block per row, grid-stride over rows. Every thread visits the same columns of every
// row (c = threadIdx.x, + blockDim.x, ...), which is what lets backward keep per-block
// partial sums for gamma and beta without atomics.
template <typename T>
__device__ void residual_dropout_layer_norm_forward(
    const T* x, const T* residual, const typename Element<T>::acc* gamma, const typename Element<T>::acc* beta,
    T* y, T* h, typename Element<T>::acc* mean_out, typename Element<T>::acc* rstd_out, long long rows,
    int cols, float p, unsigned long long seed, double eps) {
    typedef typename Element<T>::acc A;
    __shared__ A scratch[32];
    const A scale = p > 0.0f ? A(1) / (A(1) - A(p)) : A(1);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * cols;
        // h = residual + dropout(x), rounded to T exactly as the unfused ops would round it.
        // When h is not materialised (no residual, no dropout) it is x.
        const T* h_row = h ? h + base : x + base;
        A sum = A(0);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            A v = Element<T>::load(x[base + c]);
            if (h) {
                if (p > 0.0f) v = keep(seed, base + c, p) ? v * scale : A(0);
                if (residual) v += Element<T>::load(residual[base + c]);
                const T rounded = Element<T>::store(v);
                h[base + c] = rounded;  // re-read below by this same thread: no barrier needed
                v = Element<T>::load(rounded);
            }
            sum += v;
        }
        const A mean = block_sum(sum, scratch) / A(cols);
        A squares = A(0);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const A d = Element<T>::load(h_row[c]) - mean;
            squares += d * d;
        }
        const A rstd = wb_rsqrt(block_sum(squares, scratch) / A(cols) + A(eps));
        if (threadIdx.x == 0) {
            mean_out[row] = mean;
            rstd_out[row] = rstd;
        }
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const A normalized = (Element<T>::load(h_row[c]) - mean) * rstd;
            y[base + c] = Element<T>::store(normalized * gamma[c] + beta[c]);
        }
    }
}

// dh = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dh_in, with g = dy * gamma and
// xhat = (h - mean) * rstd; then d_residual = dh and dx = dh * mask * scale.
// dh_in is the gradient that reaches h directly (h is also the residual stream that the next
// sublayer adds to); it may be absent. The gradients of gamma and beta are sums over rows:
// each block adds its rows into its own row of the partial buffers (zeroed by the caller).
template <typename T>
__device__ void residual_dropout_layer_norm_backward(
    const T* dy, const T* dh_in, const T* h, const typename Element<T>::acc* gamma,
    const typename Element<T>::acc* mean, const typename Element<T>::acc* rstd, T* dx, T* dresidual,
    typename Element<T>::acc* dgamma_partial, typename Element<T>::acc* dbeta_partial, long long rows,
    int cols, float p, unsigned long long seed) {
    typedef typename Element<T>::acc A;
    __shared__ A scratch[32];
    const A scale = p > 0.0f ? A(1) / (A(1) - A(p)) : A(1);
    A* dgamma_block = dgamma_partial + blockIdx.x * (long long)cols;
    A* dbeta_block = dbeta_partial + blockIdx.x * (long long)cols;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * cols;
        const A m = mean[row];
        const A s = rstd[row];
        A sum_g = A(0);
        A sum_g_xhat = A(0);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const A grad_y = Element<T>::load(dy[base + c]);
            const A xhat = (Element<T>::load(h[base + c]) - m) * s;
            const A g = grad_y * gamma[c];
            sum_g += g;
            sum_g_xhat += g * xhat;
            dgamma_block[c] += grad_y * xhat;
            dbeta_block[c] += grad_y;
        }
        const A mean_g = block_sum(sum_g, scratch) / A(cols);
        const A mean_g_xhat = block_sum(sum_g_xhat, scratch) / A(cols);
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const A xhat = (Element<T>::load(h[base + c]) - m) * s;
            const A g = Element<T>::load(dy[base + c]) * gamma[c];
            A dh = s * (g - mean_g - xhat * mean_g_xhat);
            if (dh_in) dh += Element<T>::load(dh_in[base + c]);
            if (dresidual) dresidual[base + c] = Element<T>::store(dh);
            if (p > 0.0f) dh = keep(seed, base + c, p) ? dh * scale : A(0);
            dx[base + c] = Element<T>::store(dh);
        }
    }
}

#define WB_RESIDUAL_DROPOUT_LAYER_NORM(SUFFIX, T)                                                        \
    extern "C" __global__ void residual_dropout_layer_norm_forward_##SUFFIX(                             \
        const T* x, const T* residual, const Element<T>::acc* gamma, const Element<T>::acc* beta, T* y,   \
        T* h, Element<T>::acc* mean, Element<T>::acc* rstd, long long rows, int cols, float p,            \
        unsigned long long seed, double eps) {                                                           \
        residual_dropout_layer_norm_forward<T>(x, residual, gamma, beta, y, h, mean, rstd, rows, cols, p, \
                                               seed, eps);                                                \
    }                                                                                                    \
    extern "C" __global__ void residual_dropout_layer_norm_backward_##SUFFIX(                            \
        const T* dy, const T* dh_in, const T* h, const Element<T>::acc* gamma, const Element<T>::acc* mean, \
        const Element<T>::acc* rstd, T* dx, T* dresidual, Element<T>::acc* dgamma_partial,                \
        Element<T>::acc* dbeta_partial, long long rows, int cols, float p, unsigned long long seed) {    \
        residual_dropout_layer_norm_backward<T>(dy, dh_in, h, gamma, mean, rstd, dx, dresidual,          \
                                                dgamma_partial, dbeta_partial, rows, cols, p, seed);     \
    }

WB_FOR_EACH_DTYPE(WB_RESIDUAL_DROPOUT_LAYER_NORM)
