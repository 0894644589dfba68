// Image preparation for the service's GPU JPEG path: decoded 8-bit RGB pictures (HWC, any row
// pitch, as stored) -> each one's EXIF orientation applied -> resized to the model's H x W -> one
// dense uint8 NHWC row of the batch's input each. One launch takes a whole batch: the jobs travel
// by value in the kernel's parameters (no table to upload or keep alive), blockIdx.z picks the
// job; a host thread that launches pays one driver call per batch, not one per picture. Bit-identical to the CPU path (dualtrack.imaging:
// ImageOps.exif_transpose, then Pillow's Image.resize with Resampling.BILINEAR), so a picture
// gives the model the same pixels whichever decoder ran (the decoders themselves differ slightly).
//
// Pillow's BILINEAR is a separable triangle filter whose support widens with the downscale factor
// (antialiased), in two passes: horizontal, with each intermediate value rounded to 8 bits, then
// vertical. Coefficients are computed in double exactly as Pillow's precompute_coeffs does
// (libImaging/Resample.c), then fixed point with 22 fraction bits (normalize_coeffs_8bpc); sums
// start at 1 << 21 and are shifted back (clip8). Every double operation is an explicit _rn
// intrinsic so NVRTC cannot contract a multiply and an add into an fma: Pillow's C code (x86-64,
// no FMA) rounds each one, and one different coefficient bit can move a pixel by one.
//
// One block per RESIZE_TILE x RESIZE_TILE output pixels: the tile's column and row coefficients are
// computed once into shared memory (one warp each), then each thread computes its pixel: for each
// vertical tap, the horizontal pass of that source row (rounded to 8 bits), weighted. Both passes
// run in the displayed frame; the source is read through the orientation's index map.
//
// Taps per output pixel and axis: 2 * ceil(scale) + 1 <= RESIZE_MAX_TAPS, so a caller keeps the
// downscale factor at most (RESIZE_MAX_TAPS - 1) / 2 per axis (ResizeRgbSpec.supported); the kernel
// writes nothing for a larger one rather than a wrong picture.
// No toolkit #include: see conv3x3_nhwc.cu. The sizes come from dualtrack.kernels as -D macros.

#if !defined(RESIZE_TILE) || !defined(RESIZE_MAX_TAPS) || !defined(RESIZE_MAX_ROWS)
#error "launch sizes come from dualtrack.kernels: build with `python -m dualtrack.ptx`"
#endif

static_assert(RESIZE_TILE * RESIZE_TILE <= 1024, "one thread per output pixel of the tile");
static_assert(RESIZE_TILE <= 32, "one warp computes a tile's coefficients per axis");

#define RESIZE_PRECISION_BITS 22  // Pillow's PRECISION_BITS for 8-bit images: 32 - 8 - 2

// One picture and the row it is resized into (dualtrack.kernels.resize_rgb.ResizeJob: 32 bytes).
struct ResizeJob {
    const unsigned char* src;  // stored picture, 3 bytes a pixel, rows src_pitch bytes apart
    unsigned char* dst;        // out_h x out_w x 3, dense
    int src_w, src_h, src_pitch, orientation;
};

// A launch's jobs, by value: blockIdx.z < the launch's grid depth indexes them.
struct ResizeJobs {
    ResizeJob job[RESIZE_MAX_ROWS];
    int out_w, out_h;
};
static_assert(sizeof(ResizeJobs) <= 4096, "kernel parameters of every driver and arch: 4 KiB");

__device__ __forceinline__ double bilinear(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? __dsub_rn(1.0, x) : 0.0;
}

__device__ __forceinline__ int clip8(int v) {
    v >>= RESIZE_PRECISION_BITS;  // arithmetic shift: floor, as Pillow's lookup table indexes
    return v < 0 ? 0 : (v > 255 ? 255 : v);
}

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for output index `out` of an axis resized from
// in_size to out_size (box 0 .. in_size): the first source index, the number of taps (0 when they
// would exceed RESIZE_MAX_TAPS), and the fixed-point weights.
__device__ void axis_coeffs(int in_size, int out_size, int out, int* first, int* count, int* k) {
    const double scale = __ddiv_rn(static_cast<double>(in_size), static_cast<double>(out_size));
    const double filterscale = scale < 1.0 ? 1.0 : scale;
    const double support = filterscale;  // the triangle's support is 1.0
    const double center = __dmul_rn(__dadd_rn(static_cast<double>(out), 0.5), scale);
    const double ss = __ddiv_rn(1.0, filterscale);
    int xmin = __double2int_rz(__dadd_rn(__dsub_rn(center, support), 0.5));
    if (xmin < 0) xmin = 0;
    int xmax = __double2int_rz(__dadd_rn(__dadd_rn(center, support), 0.5));
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    if (xmax > RESIZE_MAX_TAPS) {
        *first = 0;
        *count = 0;
        return;
    }
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
        ww = __dadd_rn(ww, bilinear(__dmul_rn(__dadd_rn(__dsub_rn(static_cast<double>(x + xmin), center), 0.5), ss)));
    }
    for (int x = 0; x < xmax; ++x) {
        double w = bilinear(__dmul_rn(__dadd_rn(__dsub_rn(static_cast<double>(x + xmin), center), 0.5), ss));
        if (ww != 0.0) w = __ddiv_rn(w, ww);
        const double scaled = __dmul_rn(w, static_cast<double>(1 << RESIZE_PRECISION_BITS));
        k[x] = __double2int_rz(w < 0.0 ? __dadd_rn(-0.5, scaled) : __dadd_rn(0.5, scaled));
    }
    *first = xmin;
    *count = xmax;
}

// The stored pixel shown at displayed column u, row v under EXIF orientation 1-8 (Pillow's
// exif_transpose: 2 FLIP_LEFT_RIGHT, 3 ROTATE_180, 4 FLIP_TOP_BOTTOM, 5 TRANSPOSE, 6 ROTATE_270,
// 7 TRANSVERSE, 8 ROTATE_90); w, h: the stored size.
__device__ __forceinline__ void stored_at(int orientation, int u, int v, int w, int h, int* x, int* y) {
    switch (orientation) {
        case 2: *x = w - 1 - u; *y = v; break;
        case 3: *x = w - 1 - u; *y = h - 1 - v; break;
        case 4: *x = u; *y = h - 1 - v; break;
        case 5: *x = v; *y = u; break;
        case 6: *x = v; *y = h - 1 - u; break;
        case 7: *x = w - 1 - v; *y = h - 1 - u; break;
        case 8: *x = w - 1 - v; *y = u; break;
        default: *x = u; *y = v; break;
    }
}

// Grid (tiles across, tiles down, jobs): each block one output tile of job blockIdx.z.
extern "C" __global__ void __launch_bounds__(RESIZE_TILE * RESIZE_TILE)
resize_rgb_u8(const __grid_constant__ ResizeJobs jobs) {
    const ResizeJob& job = jobs.job[blockIdx.z];
    const unsigned char* __restrict__ src = job.src;
    unsigned char* __restrict__ dst = job.dst;
    const int src_w = job.src_w, src_h = job.src_h, src_pitch = job.src_pitch, orientation = job.orientation;
    const int out_w = jobs.out_w, out_h = jobs.out_h;
    __shared__ int kx[RESIZE_TILE][RESIZE_MAX_TAPS];
    __shared__ int ky[RESIZE_TILE][RESIZE_MAX_TAPS];
    __shared__ int x_first[RESIZE_TILE], x_count[RESIZE_TILE], y_first[RESIZE_TILE], y_count[RESIZE_TILE];

    const bool turned = orientation >= 5 && orientation <= 8;  // displayed width is the stored height
    const int shown_w = turned ? src_h : src_w;
    const int shown_h = turned ? src_w : src_h;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int ox0 = blockIdx.x * RESIZE_TILE, oy0 = blockIdx.y * RESIZE_TILE;
    if (ty == 0 && ox0 + tx < out_w) axis_coeffs(shown_w, out_w, ox0 + tx, &x_first[tx], &x_count[tx], kx[tx]);
    if (ty == 1 && oy0 + tx < out_h) axis_coeffs(shown_h, out_h, oy0 + tx, &y_first[tx], &y_count[tx], ky[tx]);
    __syncthreads();

    const int ox = ox0 + tx, oy = oy0 + ty;
    if (ox >= out_w || oy >= out_h || x_count[tx] == 0 || y_count[ty] == 0) return;
    const int half = 1 << (RESIZE_PRECISION_BITS - 1);
    int acc0 = half, acc1 = half, acc2 = half;
    for (int j = 0; j < y_count[ty]; ++j) {
        const int v = y_first[ty] + j;
        int h0 = half, h1 = half, h2 = half;
        for (int i = 0; i < x_count[tx]; ++i) {
            int sx, sy;
            stored_at(orientation, x_first[tx] + i, v, src_w, src_h, &sx, &sy);
            const unsigned char* p = src + static_cast<long long>(sy) * src_pitch + 3 * sx;
            const int k = kx[tx][i];
            h0 += p[0] * k;
            h1 += p[1] * k;
            h2 += p[2] * k;
        }
        const int k = ky[ty][j];
        acc0 += clip8(h0) * k;
        acc1 += clip8(h1) * k;
        acc2 += clip8(h2) * k;
    }
    unsigned char* d = dst + (static_cast<long long>(oy) * out_w + ox) * 3;
    d[0] = static_cast<unsigned char>(clip8(acc0));
    d[1] = static_cast<unsigned char>(clip8(acc1));
    d[2] = static_cast<unsigned char>(clip8(acc2));
}
