// oscar2-cpu.c: CPU entry points of the oscar2 KV-cache types (ggml-cpu's traits, cache writes,
// flash attention). The inner loops over the 2-bit codes are in oscar2-rows*.c.
//
//   oscar2_cpu_vec_dot_*   K.Q of an oscar2 row with the f32 query (vec_dot_type of oscar2 is
//                          F32, so the query is never re-quantized), for upstream's row-by-row
//                          flash attention (its reference path, use_ref) through the trait table.
//   oscar2_cpu_v_mad       P.V of upstream's row-by-row loop: acc += p * V row, from the codes.
//   oscar2_cpu_fa_pack_k / _v  the tiled flash attention (prefill): a tile of K (transposed) or V
//                          rows as f32, each row converted once per tile of queries; the window's
//                          rows follow the cache's.
//   oscar2_cpu_write_row   quantization for set_rows / cpy into the cache, with the clip
//                          ratio the node carries (ggml_oscar2_get_clip, oscar2-ops.h).
//   oscar2_cpu_window_kq / _v  the f16/bf16 window rows in upstream's row-by-row loop.
//   oscar2_cpu_fa_parts / _part / _fold / _finish  the row-by-row flash attention over oscar2
//                          K/V or a window (decode and short steps): the parts of a query's
//                          visible rows, the online softmax of one part in blocks, and the fold
//                          of the parts (oscar2-cpu.h says why).
//
// Each fast path sits beside its plain reference, and vector code is only compiled where the
// compiler targets that ISA.

#include "oscar2.h"
#include "oscar2-cpu.h"
#include "oscar2-ops.h"
#include "oscar2-rows.h"

#include "ggml.h"
#include "ggml-cpu.h"        // ggml_get_type_traits_cpu
#include "../ggml-cpu/vec.h" // ggml_vec_soft_max_f32, ggml_vec_mad_f32, ggml_vec_scale_f32

#include <math.h>
#include <string.h>

// ---- the cache rows in flash attention: K.Q and P.V from the 2-bit codes (oscar2-rows.h) ---

// ggml_vec_dot_t: (n, s, bs, x, bx, y, by, nrc); nrc is always 1 for our types
void oscar2_cpu_vec_dot_f32(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = oscar2_rows_dot(x, (const float *) y, n, QK_OSCAR2);
}

void oscar2_64_cpu_vec_dot_f32(int n, float * s, size_t bs, const void * x, size_t bx, const void * y, size_t by, int nrc) {
    (void) bs; (void) bx; (void) by; (void) nrc;
    *s = oscar2_rows_dot(x, (const float *) y, n, QK_OSCAR2_64);
}

void oscar2_cpu_v_mad(const void * v_row, int type, float * acc, float w, int64_t dv) {
    oscar2_rows_mad(v_row, w, acc, dv, oscar2_group_size(type));
}

// ---- quantization into the cache --------------------------------------------------------

void oscar2_cpu_write_row(const struct ggml_tensor * dst, ggml_from_float_t from_float, const float * x, void * y, int64_t k) {
    const float clip = oscar2_is_type(dst->type) ? ggml_oscar2_get_clip(dst) : 0.0f;
    if (clip != 0.0f) {
        oscar2_quantize_row_g(x, y, k, oscar2_group_size(dst->type), clip);
    } else {
        from_float(x, y, k);
    }
}

void oscar2_cpu_from_float(const float * x, void * y, int64_t k) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2, 1.0f);
}

void oscar2_64_cpu_from_float(const float * x, void * y, int64_t k) {
    oscar2_quantize_row_g(x, y, k, QK_OSCAR2_64, 1.0f);
}

// ---- high-precision window rows in the CPU flash attention -------------------------------
//
// The window's rows are f16 or bf16 (--oscar-window-type). f16 rows go through the row loops of
// oscar2-rows.h (F16C or NEON conversion, K dotted in the same pass): through ggml-base's scalar
// row conversion and a scalar dot they took about half of a CPU decode at small depth (perf of
// llama-bench, bundled model, one thread, tg32 at depth 1024). bf16 rows take the type's to_float.

float oscar2_cpu_window_kq(const void * k_row, int type, const float * q, int64_t dk) {
    if (type == GGML_TYPE_F16) {
        return oscar2_rows_f16_dot((const uint16_t *) k_row, q, dk);
    }
    float k32[1024];
    GGML_ASSERT(dk <= 1024);
    ggml_get_type_traits((enum ggml_type) type)->to_float(k_row, k32, dk);
    float s = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
        s += k32[i]*q[i];
    }
    return s;
}

void oscar2_cpu_window_v(const void * v_row, int type, float * out, int64_t dv) {
    if (type == GGML_TYPE_F16) {
        oscar2_rows_f16_to_f32((const uint16_t *) v_row, out, dv);
        return;
    }
    ggml_get_type_traits((enum ggml_type) type)->to_float(v_row, out, dv);
}

// ---- rows of K or V as f32 (both flash attentions) ----------------------------------------

// row ic of K or V as f32: cache rows first (nek1 = t->ne[1] of them), then the window's.
// seen: some query sees the row (the row-by-row path skips the others unread), so it holds a
// written token. The tiled path multiplies every row of a tile and masks afterwards, and a
// window row not written yet may hold NaN: there its non-finite values become 0 (an oscar2 row
// is finite by construction).
static void fa_row_f32(const struct ggml_tensor * t, const struct ggml_tensor * t_hp, int64_t ic, int64_t i2, int64_t i3, float * out,
                       bool seen) {
    if (ic >= t->ne[1]) {
        const char * row = (const char *) t_hp->data + (ic - t->ne[1])*t_hp->nb[1] + i2*t_hp->nb[2] + i3*t_hp->nb[3];
        oscar2_cpu_window_v(row, t_hp->type, out, t->ne[0]);
        if (!seen) {
            for (int64_t i = 0; i < t->ne[0]; ++i) {
                out[i] = isfinite(out[i]) ? out[i] : 0.0f;
            }
        }
        return;
    }
    const char * row = (const char *) t->data + ic*t->nb[1] + i2*t->nb[2] + i3*t->nb[3];
    if (oscar2_is_type(t->type)) {
        oscar2_rows_to_f32(row, out, t->ne[0], oscar2_group_size(t->type));
    } else if (t->type == GGML_TYPE_F32) {
        memcpy(out, row, t->ne[0]*sizeof(float));
    } else {
        oscar2_cpu_window_v(row, t->type, out, t->ne[0]); // f16 (F16C where built with it)
    }
}

// ---- parts of a query's rows in the row-by-row flash attention --------------------------
//
// One contiguous share of the rows per thread (upstream's split of a decode) leaves the window's
// live slots, which hold every visible token of a short context, to one thread; and a query
// decoded beside others (whole rows per thread) would be summed in another order than alone.

#define OSCAR2_FP16_NEG_INF 0xFC00u

int oscar2_cpu_fa_parts(const ggml_fp16_t * mask_row, int64_t n_kv, int n_threads, int64_t * bounds) {
    int64_t n_seen = n_kv;
    if (mask_row) {
        n_seen = 0;
        for (int64_t i = 0; i < n_kv; ++i) {
            n_seen += mask_row[i] != OSCAR2_FP16_NEG_INF;
        }
    }
    int64_t n = n_seen / OSCAR2_FA_PART_ROWS;
    n = n < n_threads ? n : n_threads;
    n = n < OSCAR2_FA_MAX_PARTS ? n : OSCAR2_FA_MAX_PARTS;
    n = n > 1 ? n : 1;
    bounds[0] = 0;
    bounds[n] = n_kv;
    // part p starts at the seen row of rank floor(p*n_seen/n)
    int64_t p = 1, rank = 0, next = n_seen/n;
    for (int64_t i = 0; i < n_kv && p < n; ++i) {
        if (mask_row && mask_row[i] == OSCAR2_FP16_NEG_INF) {
            continue;
        }
        if (rank == next) {
            bounds[p++] = i;
            next = n_seen*p/n;
        }
        ++rank;
    }
    return (int) n;
}

// A part goes through its seen rows in blocks: the block's scores, then one vector exp over
// them (ggml_vec_soft_max_f32), then its P.V with each head's accumulator held in registers
// across the block's rows (oscar2_rows_acc). Upstream's loop takes a scalar expf for every row (two
// on a new maximum), which cost more than an oscar2 row's K.q, and stores and reloads the
// accumulator for every row, a chain of dependent loads. The heads that share a K/V head (GQA)
// go together: the block's oscar2 K rows are scored for all of them from the codes
// (oscar2_rows_scores), and each V row (and a window's K row) is widened to f32 once
// (oscar2_rows_to_f32, exact) and used by each head. A head's sums do not depend on the heads
// beside it, so any grouping gives the same bits.
#define OSCAR2_FA_BLOCK      64    // rows a block at most
#define OSCAR2_FA_TILE_FLOATS 16384 // the block's V rows as f32 (64 KiB)

// the largest of x[0..n), in eight running maxima so that no compare waits for the one before
// (a maximum is exact, so the order does not matter)
static float block_max(const float * x, int n) {
    float m[8], mb = -INFINITY;
    for (int l = 0; l < 8; ++l) {
        m[l] = -INFINITY;
    }
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        for (int l = 0; l < 8; ++l) {
            m[l] = x[j + l] > m[l] ? x[j + l] : m[l];
        }
    }
    for (; j < n; ++j) {
        mb = x[j] > mb ? x[j] : mb;
    }
    for (int l = 0; l < 8; ++l) {
        mb = m[l] > mb ? m[l] : mb;
    }
    return mb;
}

void oscar2_cpu_fa_flush_weights(float * w, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
        w[j] = oscar2_cpu_fa_weight(w[j]);
    }
}

void oscar2_cpu_fa_part(const struct ggml_tensor * dst, int64_t ir, int nh, int64_t ic0, int64_t ic1,
                        float * partial, int64_t pstride) {
    const struct ggml_tensor * q     = dst->src[0];
    const struct ggml_tensor * k     = dst->src[1];
    const struct ggml_tensor * v     = dst->src[2];
    const struct ggml_tensor * mask  = dst->src[3];
    const struct ggml_tensor * sinks = dst->src[4];
    const struct ggml_tensor * k_hp  = ggml_flash_attn_ext_get_window_k(dst);
    const struct ggml_tensor * v_hp  = ggml_flash_attn_ext_get_window_v(dst);
    const int64_t dk = k->ne[0], dv = v->ne[0];
    GGML_ASSERT(dk <= 1024 && dv <= 1024 && nh >= 1 && nh <= OSCAR2_FA_MAX_GROUP);

    float scale, max_bias, softcap;
    memcpy(&scale,    (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (softcap != 0.0f) {
        scale /= softcap;
    }
    const uint32_t n_head      = (uint32_t) q->ne[2];
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));
    const float    m0          = powf(2.0f, -max_bias/n_head_log2);
    const float    m1          = powf(2.0f, -max_bias/2.0f/n_head_log2);

    // query row ir: token iq1 of head iq2 of stream iq3; the group's heads follow (rows ir + h*ne1)
    const int64_t iq3 = ir/(q->ne[2]*q->ne[1]);
    const int64_t iq2 = (ir - iq3*q->ne[2]*q->ne[1])/q->ne[1];
    const int64_t iq1 = ir - iq3*q->ne[2]*q->ne[1] - iq2*q->ne[1];
    const int64_t ik2 = iq2/(q->ne[2]/k->ne[2]), ik3 = iq3/(q->ne[3]/k->ne[3]);
    const int64_t iv2 = iq2/(q->ne[2]/v->ne[2]), iv3 = iq3/(q->ne[3]/v->ne[3]);
    const ggml_fp16_t * mp = mask ? (const ggml_fp16_t *) ((const char *) mask->data + iq1*mask->nb[1] +
                                    (iq2%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : NULL;

    const float * qh[OSCAR2_FA_MAX_GROUP];
    float slope[OSCAR2_FA_MAX_GROUP], M[OSCAR2_FA_MAX_GROUP], S[OSCAR2_FA_MAX_GROUP];
    for (int h = 0; h < nh; ++h) {
        const uint32_t head = (uint32_t) (iq2 + h);
        qh[h]    = (const float *) ((const char *) q->data + iq1*q->nb[1] + (iq2 + h)*q->nb[2] + iq3*q->nb[3]);
        slope[h] = max_bias <= 0.0f ? 1.0f : head < n_head_log2 ? powf(m0, head + 1) : powf(m1, 2*(head - n_head_log2) + 1);
        M[h]     = -INFINITY;
        S[h]     = 0.0f;
        memset(partial + h*pstride + 2, 0, dv*sizeof(float));
    }

    // the cache's oscar2 K rows are scored from their codes (oscar2_rows_scores)
    const int k_codes = oscar2_is_type(k->type);
    const int kG      = k_codes ? oscar2_group_size(k->type) : 0;

    const int nb = (int) (OSCAR2_FA_TILE_FLOATS/dv < OSCAR2_FA_BLOCK ? OSCAR2_FA_TILE_FLOATS/dv : OSCAR2_FA_BLOCK);
    float   sc[OSCAR2_FA_MAX_GROUP][OSCAR2_FA_BLOCK], mvs[OSCAR2_FA_BLOCK], row[1024], tile[OSCAR2_FA_TILE_FLOATS];
    int64_t rows[OSCAR2_FA_BLOCK];
    const uint8_t * k_rows[OSCAR2_FA_BLOCK];
    for (int64_t ic = ic0; ic < ic1; ) {
        int n = 0;
        for (; ic < ic1 && n < nb; ++ic) {
            const float mv = mp ? GGML_CPU_FP16_TO_FP32(mp[ic]) : 0.0f;
            if (mv == -INFINITY) {
                continue;
            }
            mvs[n]    = mv;
            rows[n++] = ic;
        }
        if (n == 0) {
            break;
        }
        // K.q: the cache's rows come first in a block (rows ascend), the window's after them
        int n_codes = 0;
        for (; k_codes && n_codes < n && rows[n_codes] < k->ne[1]; ++n_codes) {
            k_rows[n_codes] = (const uint8_t *) k->data + rows[n_codes]*k->nb[1] + ik2*k->nb[2] + ik3*k->nb[3];
        }
        if (n_codes > 0) {
            oscar2_rows_scores(k_rows, n_codes, qh, nh, dk, kG, &sc[0][0], OSCAR2_FA_BLOCK);
        }
        for (int j = n_codes; j < n; ++j) {
            fa_row_f32(k, k_hp, rows[j], ik2, ik3, row, true);
            for (int h = 0; h < nh; ++h) {
                ggml_vec_dot_f32((int) dk, &sc[h][j], 0, row, 0, qh[h], 0, 1);
            }
        }
        for (int h = 0; h < nh; ++h) {
            for (int j = 0; j < n; ++j) {
                float s = sc[h][j]*scale;
                if (softcap != 0.0f) {
                    s = softcap*tanhf(s);
                }
                sc[h][j] = s + slope[h]*mvs[j];
            }
        }
        for (int j = 0; j < n; ++j) {
            fa_row_f32(v, v_hp, rows[j], iv2, iv3, tile + j*dv, true);
        }
        for (int h = 0; h < nh; ++h) { // the block's weights exp(s - M), M the running maximum
            float * acc = partial + h*pstride + 2;
            const float mb = block_max(sc[h], n);
            if (mb > M[h]) {
                const float ms = oscar2_cpu_fa_weight(expf(M[h] - mb)); // 0 at the first block
                ggml_vec_scale_f32((int) dv, acc, ms);
                S[h] *= ms;
                M[h]  = mb;
            }
            S[h] += (float) ggml_vec_soft_max_f32(n, sc[h], sc[h], M[h]);
            oscar2_cpu_fa_flush_weights(sc[h], n);
            oscar2_rows_acc(tile, sc[h], n, acc, dv);
        }
    }

    for (int h = 0; h < nh; ++h) {
        float * acc = partial + h*pstride + 2;
        // the sink of the head (attention sinks) counts once, in the first part
        if (sinks && ic0 == 0) {
            const float s = ((const float *) sinks->data)[iq2 + h];
            if (s > M[h]) {
                const float ms = expf(M[h] - s);
                ggml_vec_scale_f32((int) dv, acc, ms);
                S[h] = S[h]*ms + 1.0f;
                M[h] = s;
            } else {
                S[h] += expf(s - M[h]);
            }
        }
        partial[h*pstride + 0] = M[h];
        partial[h*pstride + 1] = S[h];
    }
}

void oscar2_cpu_fa_fold(float * acc, const float * part, int64_t dv) {
    if (part[1] == 0.0f) {
        return; // nothing seen
    }
    const float m  = fmaxf(acc[0], part[0]);
    const float so = expf(acc[0] - m);
    const float sn = expf(part[0] - m);
    for (int64_t d = 0; d < dv; ++d) {
        acc[2 + d] = acc[2 + d]*so + part[2 + d]*sn;
    }
    acc[1] = acc[1]*so + part[1]*sn;
    acc[0] = m;
}

void oscar2_cpu_fa_finish(const float * acc, float * out, int64_t dv) {
    const float s_inv = acc[1] == 0.0f ? 0.0f : 1.0f/acc[1];
    for (int64_t d = 0; d < dv; ++d) {
        out[d] = acc[2 + d]*s_inv;
    }
}

// ---- tiles of the tiled flash attention (prefill) ----------------------------------------

int oscar2_cpu_fa_tiled(const struct ggml_tensor * k, const struct ggml_tensor * v) {
    const int ko = oscar2_is_type(k->type), vo = oscar2_is_type(v->type);
    const int kf = k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_F32;
    const int vf = v->type == GGML_TYPE_F16 || v->type == GGML_TYPE_F32;
    return (ko || vo) && (ko || kf) && (vo || vf);
}

void oscar2_cpu_fa_pack_k(const struct ggml_tensor * k, const struct ggml_tensor * k_hp, int64_t ic, int n_rows, int tile,
                          int64_t ik2, int64_t ik3, float * k_t) {
    float row[1024];
    const int64_t dk = k->ne[0];
    GGML_ASSERT(dk <= 1024);
    for (int r = 0; r < n_rows; ++r) {
        fa_row_f32(k, k_hp, ic + r, ik2, ik3, row, false);
        for (int64_t i = 0; i < dk; ++i) {
            k_t[i*tile + r] = row[i];
        }
    }
}

void oscar2_cpu_fa_pack_v(const struct ggml_tensor * v, const struct ggml_tensor * v_hp, int64_t ic, int n_rows,
                          int64_t iv2, int64_t iv3, float * v_tile) {
    for (int r = 0; r < n_rows; ++r) {
        fa_row_f32(v, v_hp, ic + r, iv2, iv3, v_tile + r*v->ne[0], false);
    }
}
