// GENERATED from the activation table, dualtrack.contract.activations (render_header): do not edit.
// `make ptx` (python -m dualtrack.compiler.kernel_build) rewrites it; its --check says when it is stale.
//
// dt_activate(v, act, p0, p1): the fused activation `act` (an id of the table) with its parameters
// p0, p1, in fp32. NaN propagates through every one of them, as through numpy.
#ifndef DUALTRACK_ACTIVATIONS_CUH
#define DUALTRACK_ACTIVATIONS_CUH

__device__ __forceinline__ float dt_clamp_nan(float v, float lo, float hi) {
    // fminf/fmaxf would turn NaN into a bound; the comparisons keep it.
    return v < lo ? lo : (v > hi ? hi : v);
}

__device__ __forceinline__ float dt_softplus(float v) {
    // log(1 + e^v) without overflow; fmaxf's NaN-to-0 is harmless: the log1p term is NaN then.
    return fmaxf(v, 0.0f) + log1pf(expf(-fabsf(v)));
}

enum DtAct : int {
    DT_ACT_NONE = 0,
    DT_ACT_RELU = 1,
    DT_ACT_CLIP = 2,
    DT_ACT_HARDSIGMOID = 3,
    DT_ACT_HARDSWISH = 4,
    DT_ACT_SIGMOID = 5,
    DT_ACT_SILU = 6,
    DT_ACT_LEAKYRELU = 7,
    DT_ACT_ELU = 8,
    DT_ACT_SELU = 9,
    DT_ACT_TANH = 10,
    DT_ACT_SOFTPLUS = 11,
    DT_ACT_MISH = 12,
    DT_ACT_GELU = 13,
    DT_ACT_GELU_TANH = 14,
    DT_ACT_SOFTSIGN = 15,
    DT_ACT_CELU = 16,
};

__device__ __forceinline__ float dt_act_none(float v, float p0, float p1) { return v; }
__device__ __forceinline__ float dt_act_relu(float v, float p0, float p1) { return v < 0.0f ? 0.0f : v; }
__device__ __forceinline__ float dt_act_clip(float v, float p0, float p1) { return dt_clamp_nan(v, p0, p1); }
__device__ __forceinline__ float dt_act_hardsigmoid(float v, float p0, float p1) { return dt_clamp_nan(fmaf(p0, v, p1), 0.0f, 1.0f); }
__device__ __forceinline__ float dt_act_hardswish(float v, float p0, float p1) { return v * dt_clamp_nan(fmaf(v, 1.0f / 6.0f, 0.5f), 0.0f, 1.0f); }
__device__ __forceinline__ float dt_act_sigmoid(float v, float p0, float p1) { return 1.0f / (1.0f + expf(-v)); }
__device__ __forceinline__ float dt_act_silu(float v, float p0, float p1) { return v / (1.0f + expf(-v)); }
__device__ __forceinline__ float dt_act_leakyrelu(float v, float p0, float p1) { return v < 0.0f ? p0 * v : v; }
__device__ __forceinline__ float dt_act_elu(float v, float p0, float p1) { return v < 0.0f ? p0 * expm1f(v) : v; }
__device__ __forceinline__ float dt_act_selu(float v, float p0, float p1) { return v > 0.0f ? p1 * v : p1 * (p0 * expm1f(v)); }
__device__ __forceinline__ float dt_act_tanh(float v, float p0, float p1) { return tanhf(v); }
__device__ __forceinline__ float dt_act_softplus(float v, float p0, float p1) { return dt_softplus(v); }
__device__ __forceinline__ float dt_act_mish(float v, float p0, float p1) { return v * tanhf(dt_softplus(v)); }
__device__ __forceinline__ float dt_act_gelu(float v, float p0, float p1) { return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f)); }
__device__ __forceinline__ float dt_act_gelu_tanh(float v, float p0, float p1) { return 0.5f * v * (1.0f + tanhf(0.79788456080286536f * fmaf(0.044715f * v, v * v, v))); }
__device__ __forceinline__ float dt_act_softsign(float v, float p0, float p1) { return v / (1.0f + fabsf(v)); }
__device__ __forceinline__ float dt_act_celu(float v, float p0, float p1) { return v < 0.0f ? p0 * expm1f(v / p0) : v; }

__device__ __noinline__ float dt_activate_rest(float v, int act, float p0, float p1) {
    switch (act) {
        case DT_ACT_ELU: return dt_act_elu(v, p0, p1);
        case DT_ACT_SELU: return dt_act_selu(v, p0, p1);
        case DT_ACT_TANH: return dt_act_tanh(v, p0, p1);
        case DT_ACT_SOFTPLUS: return dt_act_softplus(v, p0, p1);
        case DT_ACT_MISH: return dt_act_mish(v, p0, p1);
        case DT_ACT_GELU: return dt_act_gelu(v, p0, p1);
        case DT_ACT_GELU_TANH: return dt_act_gelu_tanh(v, p0, p1);
        case DT_ACT_SOFTSIGN: return dt_act_softsign(v, p0, p1);
        case DT_ACT_CELU: return dt_act_celu(v, p0, p1);
        default: return v;
    }
}

__device__ __forceinline__ float dt_activate(float v, int act, float p0, float p1) {
    if (act > DT_ACT_LEAKYRELU) return dt_activate_rest(v, act, p0, p1);
    switch (act) {
        case DT_ACT_RELU: return dt_act_relu(v, p0, p1);
        case DT_ACT_CLIP: return dt_act_clip(v, p0, p1);
        case DT_ACT_HARDSIGMOID: return dt_act_hardsigmoid(v, p0, p1);
        case DT_ACT_HARDSWISH: return dt_act_hardswish(v, p0, p1);
        case DT_ACT_SIGMOID: return dt_act_sigmoid(v, p0, p1);
        case DT_ACT_SILU: return dt_act_silu(v, p0, p1);
        case DT_ACT_LEAKYRELU: return dt_act_leakyrelu(v, p0, p1);
        default: return v;
    }
}

template <int N>
__device__ __forceinline__ void dt_activate_n(float (&v)[N], int act, float p0, float p1) {
    if (act > DT_ACT_LEAKYRELU) {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = dt_activate_rest(v[i], act, p0, p1);
        return;
    }
    switch (act) {
        case DT_ACT_RELU:
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = dt_act_relu(v[i], p0, p1);
            break;
        case DT_ACT_CLIP:
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = dt_act_clip(v[i], p0, p1);
            break;
        case DT_ACT_HARDSIGMOID:
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = dt_act_hardsigmoid(v[i], p0, p1);
            break;
        case DT_ACT_HARDSWISH:
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = dt_act_hardswish(v[i], p0, p1);
            break;
        case DT_ACT_SIGMOID:
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = dt_act_sigmoid(v[i], p0, p1);
            break;
        case DT_ACT_SILU:
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = dt_act_silu(v[i], p0, p1);
            break;
        case DT_ACT_LEAKYRELU:
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] = dt_act_leakyrelu(v[i], p0, p1);
            break;
        default: break;
    }
}

#endif  // DUALTRACK_ACTIVATIONS_CUH
