// adamw.cu: one AdamW step for every parameter tensor of a model in a single launch.
//
// Why fuse: torch.optim.AdamW's default (foreach) implementation runs about ten multi-tensor
// kernels per step (lerp, mul, addcmul, sqrt, div, add, addcdiv, ...), and each reads and
// writes the parameters or the optimizer state again. This kernel reads a parameter, its
// gradient and its two moments once and writes the parameter and the moments once: 16 bytes
// read and 12 written per fp32 parameter, the least an AdamW step can move.
//
// Multi-tensor: the tensors stay where they are (no flattened copy). The launcher splits every
// tensor into chunks and gives each block one chunk: chunk_tensor[b] says which tensor block b
// works on and chunk_start[b] where its chunk begins. The tensors' addresses come in as 64-bit
// integers in device memory. The arithmetic follows torch.optim.AdamW's order of operations,
// so the result matches it to rounding:
//   p *= 1 - lr * weight_decay                    (decoupled weight decay)
//   m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
//   p -= lr / bias_correction1 * m / (sqrt(v) / sqrt(bias_correction2) + eps)
// Parameters and gradients are T; the moments are kept in the accumulation type (float for
// fp16/bf16/fp32 parameters), so low-precision parameters still accumulate in fp32.
#include "common.cuh"

template <typename A> __device__ __forceinline__ A lerp_like_torch(A start, A end, A weight) {
    // torch.lerp's formula: exact at both ends for either half of the weight's range.
    return weight < A(0.5) ? start + weight * (end - start) : end - (end - start) * (A(1) - weight);
}

template <typename T>
__device__ void adamw_step(const unsigned long long* params, const unsigned long long* grads,
                           const unsigned long long* exp_avgs, const unsigned long long* exp_avg_sqs,
                           const long long* sizes, const int* chunk_tensor, const long long* chunk_start,
                           int chunk_size, double lr, double beta1, double beta2, double eps, double weight_decay,
                           double bias_correction1, double bias_correction2_sqrt) {
    typedef typename Element<T>::acc A;
    const int tensor = chunk_tensor[blockIdx.x];
    const long long start = chunk_start[blockIdx.x];
    const long long end = min(start + chunk_size, sizes[tensor]);
    T* param = reinterpret_cast<T*>(params[tensor]);
    const T* grad = reinterpret_cast<const T*>(grads[tensor]);
    A* exp_avg = reinterpret_cast<A*>(exp_avgs[tensor]);
    A* exp_avg_sq = reinterpret_cast<A*>(exp_avg_sqs[tensor]);
    const A decay = A(1) - A(lr) * A(weight_decay);
    const A step_size = A(lr) / A(bias_correction1);
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const A g = Element<T>::load(grad[i]);
        const A m = lerp_like_torch(exp_avg[i], g, A(1) - A(beta1));
        const A v = exp_avg_sq[i] * A(beta2) + g * g * (A(1) - A(beta2));
        const A denom = wb_sqrt(v) / A(bias_correction2_sqrt) + A(eps);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = Element<T>::store(Element<T>::load(param[i]) * decay - step_size * (m / denom));
    }
}

#define WB_ADAMW(SUFFIX, T)                                                                                  \
    extern "C" __global__ void adamw_step_##SUFFIX(                                                          \
        const unsigned long long* params, const unsigned long long* grads, const unsigned long long* exp_avgs, \
        const unsigned long long* exp_avg_sqs, const long long* sizes, const int* chunk_tensor,              \
        const long long* chunk_start, int chunk_size, double lr, double beta1, double beta2, double eps,     \
        double weight_decay, double bias_correction1, double bias_correction2_sqrt) {                       \
        adamw_step<T>(params, grads, exp_avgs, exp_avg_sqs, sizes, chunk_tensor, chunk_start, chunk_size, lr, \
                      beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt);             \
    }

WB_FOR_EACH_DTYPE(WB_ADAMW)
