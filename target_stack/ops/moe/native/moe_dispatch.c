/* target_stack's native MoE dispatch / expert / combine step for the CPU prefill path.
 *
 * dispatch: a counting sort of the (token, expert) pairs by expert and a gather of the token rows
 *           into one contiguous group per expert;
 * experts:  each group through its SwiGLU expert, down(silu(gate x) * up x);
 * combine:  each result scaled by its routing weight and added into its token's output row.
 *
 * Plain C on fp32, no Python API: whether the GIL is held during the call is decided by how it is
 * loaded (ctypes.CDLL releases it, ctypes.PyDLL holds it).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

static float dot(const float *a, const float *b, int64_t n) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += a[i] * b[i];
        s1 += a[i + 1] * b[i + 1];
        s2 += a[i + 2] * b[i + 2];
        s3 += a[i + 3] * b[i + 3];
    }
    for (; i < n; ++i) s0 += a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

/* Returns 0 on success, -1 on an expert id out of range, -2 when out of memory. */
int ts_moe_dispatch_combine(int64_t T, int64_t D, int64_t H, int64_t E, int64_t K,
                            const float *x, const int64_t *experts, const float *weights,
                            const float *w_gate, const float *w_up, const float *w_down,
                            float *out) {
    const int64_t P = T * K;
    int64_t *count = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(P > 0 ? P : 1) * sizeof(int64_t));
    float *rows = malloc((size_t)(P > 0 ? P : 1) * (size_t)D * sizeof(float));
    float *hid = malloc((size_t)H * sizeof(float));
    float *y = malloc((size_t)D * sizeof(float));
    int rc = 0;
    if (!count || !order || !rows || !hid || !y) { rc = -2; goto done; }

    /* dispatch: counting sort by expert, then gather */
    for (int64_t p = 0; p < P; ++p) {
        int64_t e = experts[p];
        if (e < 0 || e >= E) { rc = -1; goto done; }
        count[e + 1]++;
    }
    for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
    {
        int64_t *fill = malloc((size_t)E * sizeof(int64_t));
        if (!fill) { rc = -2; goto done; }
        memcpy(fill, count, (size_t)E * sizeof(int64_t));
        for (int64_t p = 0; p < P; ++p) order[fill[experts[p]]++] = p;
        free(fill);
    }
    for (int64_t r = 0; r < P; ++r) memcpy(rows + r * D, x + (order[r] / K) * D, (size_t)D * sizeof(float));

    /* experts and combine, one group at a time */
    memset(out, 0, (size_t)T * (size_t)D * sizeof(float));
    for (int64_t e = 0; e < E; ++e) {
        const float *wg = w_gate + e * H * D, *wu = w_up + e * H * D, *wd = w_down + e * D * H;
        for (int64_t r = count[e]; r < count[e + 1]; ++r) {
            const float *row = rows + r * D;
            for (int64_t h = 0; h < H; ++h) {
                float g = dot(row, wg + h * D, D), u = dot(row, wu + h * D, D);
                hid[h] = g / (1.f + expf(-g)) * u;
            }
            for (int64_t d = 0; d < D; ++d) y[d] = dot(hid, wd + d * H, H);
            int64_t p = order[r];
            float w = weights[p];
            float *o = out + (p / K) * D;
            for (int64_t d = 0; d < D; ++d) o[d] += w * y[d];
        }
    }
done:
    free(count); free(order); free(rows); free(hid); free(y);
    return rc;
}

/* The GPU path's dispatch layout.  The routing decisions of a layer are copied from the device
 * into pinned host memory, followed (in stream order) by a sequence number into ``flag``.  This
 * call waits until that number is visible, which is to say until the device has finished all the
 * work queued before the routing, then sorts the (token, expert) pairs by expert:
 * ``order`` [P] (pair indices grouped by expert) and ``offsets`` [E] (the end of each group).
 * Returns 0, -1 on an expert id out of range, -2 out of memory, -3 after ``timeout_us`` without
 * the flag.
 */
static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int ts_moe_layout_wait(const volatile int32_t *flag, int32_t expected, int64_t timeout_us,
                       const int64_t *experts, int64_t P, int64_t E, int64_t *order, int64_t *offsets) {
    int64_t start = now_us();
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) != expected) {
        if (now_us() - start > timeout_us) return -3;
    }
    for (int64_t e = 0; e < E; ++e) offsets[e] = 0;
    for (int64_t p = 0; p < P; ++p) {
        if (experts[p] < 0 || experts[p] >= E) return -1;
        offsets[experts[p]]++;
    }
    for (int64_t e = 1; e < E; ++e) offsets[e] += offsets[e - 1]; /* group ends */
    int64_t *fill = malloc((size_t)(E > 0 ? E : 1) * sizeof(int64_t));
    if (!fill) return -2;
    memcpy(fill, offsets, (size_t)E * sizeof(int64_t));
    for (int64_t p = P - 1; p >= 0; --p) order[--fill[experts[p]]] = p; /* stable within a group */
    free(fill);
    return 0;
}
