// The reductions' arithmetic (creduce over a pixel's channels, gap over an image's pixels), in fp32.
// The op codes are dualtrack.contract.plan.REDUCE_OPS (tests/test_reductions.py holds this enum to it).
// A reduction maps each value (|v| for L1, v*v for L2 and SumSquare), combines the mapped values (a sum,
// or a max / min that keeps a NaN, as ONNX's reference does: fmaxf alone would drop it), and finishes
// once (the mean divides by the count, L2 takes the square root). A caller that passes a constant op
// gets the other cases folded away.

#pragma once

enum DtReduce : int {
    DT_RED_SUM = 0,
    DT_RED_MEAN = 1,
    DT_RED_MAX = 2,
    DT_RED_MIN = 3,
    DT_RED_L1 = 4,
    DT_RED_L2 = 5,
    DT_RED_SUMSQUARE = 6,
};

__device__ __forceinline__ bool dt_red_is_extreme(int op) { return op == DT_RED_MAX || op == DT_RED_MIN; }

__device__ __forceinline__ float dt_red_init(int op) {
    return op == DT_RED_MAX ? __int_as_float(0xff800000u) : op == DT_RED_MIN ? __int_as_float(0x7f800000u) : 0.0f;
}

__device__ __forceinline__ float dt_red_map(float v, int op) {
    return op == DT_RED_L1 ? fabsf(v) : (op == DT_RED_L2 || op == DT_RED_SUMSQUARE) ? v * v : v;
}

__device__ __forceinline__ float dt_red_combine(float a, float b, int op) {
    if (!dt_red_is_extreme(op)) return a + b;
    if (a != a) return a;  // a NaN seen stays
    if (b != b) return b;
    return op == DT_RED_MAX ? fmaxf(a, b) : fminf(a, b);
}

__device__ __forceinline__ float dt_red_finish(float a, float count, int op) {
    return op == DT_RED_MEAN ? a / count : op == DT_RED_L2 ? sqrtf(a) : a;
}
