// bias_gelu.cu: y = GELU(x + bias), the bias of a Linear layer fused with the exact (erf)
// GELU that follows it, forward and backward.
//
// Why fuse: unfused, `F.gelu(x + bias)` is two elementwise kernels, and the intermediate
// x + bias makes a round trip through DRAM. In training the bigger win is backward: PyTorch
// computes dx = dy * GELU'(x + bias) in one kernel and then reads dx again to reduce it over
// the rows into the bias gradient; here one pass over dy and x writes dx and the bias
// gradient together. Neither kernel does enough arithmetic per byte to be limited by anything
// but memory bandwidth, so their speed is judged in GB/s against a plain device copy.
//
// x, y, dy, dx: a contiguous (rows, cols) matrix of T; bias and its gradient: cols values in
// the accumulation type (float, or double for fp64).
#include "common.cuh"

template <typename A> __device__ __forceinline__ A gelu(A v) {
    return A(0.5) * v * (A(1) + wb_erf(v * A(0.70710678118654752440)));
}

// d/dv GELU(v) = Phi(v) + v * phi(v), with Phi, phi the standard normal CDF and density.
template <typename A> __device__ __forceinline__ A gelu_grad(A v) {
    const A cdf = A(0.5) * (A(1) + wb_erf(v * A(0.70710678118654752440)));
    const A pdf = wb_exp(A(-0.5) * v * v) * A(0.39894228040143267794);
    return cdf + v * pdf;
}

// Elementwise over all rows * cols elements with a grid-stride loop. The column of element i
// is tracked incrementally, so the loop needs no 64-bit division.
template <typename T>
__device__ void bias_gelu_forward(const T* x, const typename Element<T>::acc* bias, T* y,
                                  long long n, int cols) {
    typedef typename Element<T>::acc A;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int col_step = (int)(stride % cols);
    int col = (int)(first % cols);
    for (long long i = first; i < n; i += stride) {
        y[i] = Element<T>::store(gelu(Element<T>::load(x[i]) + bias[col]));
        col += col_step;
        if (col >= cols) col -= cols;
    }
}

// Blocks of 32 x 8 threads. threadIdx.x runs along a row, so each warp reads 32 neighbouring
// columns (coalesced); the 8 rows of threads and the blocks of grid y stride down the rows.
// Each thread keeps its column's share of the bias gradient in a register; the block adds its
// 8 shares and writes one partial sum per column to dbias_partial[blockIdx.y][col]. The
// caller adds the gridDim.y partial rows (a few dozen): no atomics, so the result is
// deterministic.
template <typename T>
__device__ void bias_gelu_backward(const T* dy, const T* x, const typename Element<T>::acc* bias, T* dx,
                                   typename Element<T>::acc* dbias_partial, long long rows, int cols) {
    typedef typename Element<T>::acc A;
    __shared__ A shares[8][33];  // 33: no shared-memory bank conflicts on the column sums
    const int col = blockIdx.x * 32 + threadIdx.x;
    A share = A(0);
    if (col < cols) {
        const A b = bias[col];
        for (long long row = blockIdx.y * 8LL + threadIdx.y; row < rows; row += gridDim.y * 8LL) {
            const long long i = row * cols + col;
            const A grad = Element<T>::load(dy[i]) * gelu_grad(Element<T>::load(x[i]) + b);
            dx[i] = Element<T>::store(grad);
            share += grad;
        }
    }
    shares[threadIdx.y][threadIdx.x] = share;
    __syncthreads();
    if (threadIdx.y == 0 && col < cols) {
        A total = A(0);
        for (int k = 0; k < 8; ++k) total += shares[k][threadIdx.x];
        dbias_partial[blockIdx.y * (long long)cols + col] = total;
    }
}

#define WB_BIAS_GELU(SUFFIX, T)                                                                    \
    extern "C" __global__ void bias_gelu_forward_##SUFFIX(const T* x, const Element<T>::acc* bias, \
                                                          T* y, long long n, int cols) {           \
        bias_gelu_forward<T>(x, bias, y, n, cols);                                                 \
    }                                                                                              \
    extern "C" __global__ void bias_gelu_backward_##SUFFIX(                                        \
        const T* dy, const T* x, const Element<T>::acc* bias, T* dx, Element<T>::acc* dbias_partial, \
        long long rows, int cols) {                                                                \
        bias_gelu_backward<T>(dy, x, bias, dx, dbias_partial, rows, cols);                         \
    }

WB_FOR_EACH_DTYPE(WB_BIAS_GELU)
