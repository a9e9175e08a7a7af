// oscar2_ops.c: run the real ggml CPU ops on oscar2 caches, for tests/test_oscar2_cpu.py.
//
//   oscar2_ops KT VT D DV N_KV N_Q H H_KV CLIP_K CLIP_V N_THREADS DIR [N_HP]
//
// Reads DIR/q.f32 [H][N_Q][D], DIR/k.f32 [N_KV][H_KV*D], DIR/v.f32 [N_KV][H_KV*DV] and
// DIR/mask.f16 [N_Q][N_KV]; writes the K and V caches into DIR/kc.bin and DIR/vc.bin
// through GGML_OP_SET_ROWS (with the clip ratio in op_params[0], as the KV cache does),
// reads them back through GGML_OP_GET_ROWS into DIR/kdeq.f32, and writes the flash
// attention output [N_Q][H][DV] into DIR/out.f32. KT/VT are ggml type names (oscar2,
// oscar2_64, f16, q4_0, ...). The test compares all of it with the numpy reference.
//
// With N_HP > 0, DIR/khp.f32 and DIR/vhp.f32 [N_HP][H_KV*D] are stored as f16 high-precision
// window rows (ggml_flash_attn_ext_add_window) and the mask is DIR/mask.f16 [N_Q][N_KV + N_HP].
#include "ggml.h"
#include "ggml-cpu.h"

// from ggml-oscar/oscar2-ops.h (the test builds against the public headers only)
void ggml_flash_attn_ext_add_window(struct ggml_tensor * a, struct ggml_tensor * k_hp, struct ggml_tensor * v_hp);

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static enum ggml_type type_by_name(const char * s) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((enum ggml_type) t);
        if (n && strcmp(n, s) == 0) return (enum ggml_type) t;
    }
    fprintf(stderr, "unknown type %s\n", s);
    exit(2);
}

static void read_file(const char * dir, const char * name, void * dst, size_t n) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE * f = fopen(path, "rb");
    if (!f || fread(dst, 1, n, f) != n) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
    fclose(f);
}

static void write_file(const char * dir, const char * name, const void * src, size_t n) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE * f = fopen(path, "wb");
    if (!f || fwrite(src, 1, n, f) != n) { fprintf(stderr, "cannot write %s\n", path); exit(2); }
    fclose(f);
}

int main(int argc, char ** argv) {
    if (argc != 13 && argc != 14) {
        fprintf(stderr, "usage: %s KT VT D DV N_KV N_Q H H_KV CLIP_K CLIP_V N_THREADS DIR [N_HP]\n", argv[0]);
        return 2;
    }
    const int n_hp = argc == 14 ? atoi(argv[13]) : 0;
    const enum ggml_type kt = type_by_name(argv[1]);
    const enum ggml_type vt = type_by_name(argv[2]);
    const int D = atoi(argv[3]), DV = atoi(argv[4]), n_kv = atoi(argv[5]), n_q = atoi(argv[6]);
    const int H = atoi(argv[7]), H_kv = atoi(argv[8]);
    const float clip_k = (float) atof(argv[9]), clip_v = (float) atof(argv[10]);
    const int n_threads = atoi(argv[11]);
    const char * dir = argv[12];

    struct ggml_init_params ip = { (size_t) 512*1024*1024, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);

    struct ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, n_q, H);
    struct ggml_tensor * kf   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D*H_kv, n_kv);
    struct ggml_tensor * vf   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, DV*H_kv, n_kv);
    struct ggml_tensor * kc   = ggml_new_tensor_2d(ctx, kt, D*H_kv, n_kv);
    struct ggml_tensor * vc   = ggml_new_tensor_2d(ctx, vt, DV*H_kv, n_kv);
    struct ggml_tensor * idx  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_kv);
    struct ggml_tensor * ridx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_kv);
    struct ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv + n_hp, n_q);
    struct ggml_tensor * khp  = NULL, * vhp = NULL;
    if (n_hp > 0) {
        // window rows in f16, laid out like the window store: [H_KV*D, N_HP]
        struct ggml_tensor * kh32 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D*H_kv, n_hp);
        struct ggml_tensor * vh32 = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, DV*H_kv, n_hp);
        read_file(dir, "khp.f32", kh32->data, ggml_nbytes(kh32));
        read_file(dir, "vhp.f32", vh32->data, ggml_nbytes(vh32));
        khp = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, D*H_kv, n_hp);
        vhp = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, DV*H_kv, n_hp);
        ggml_fp32_to_fp16_row((const float *) kh32->data, (ggml_fp16_t *) khp->data, ggml_nelements(kh32));
        ggml_fp32_to_fp16_row((const float *) vh32->data, (ggml_fp16_t *) vhp->data, ggml_nelements(vh32));
    }

    read_file(dir, "q.f32", q->data, ggml_nbytes(q));
    read_file(dir, "k.f32", kf->data, ggml_nbytes(kf));
    read_file(dir, "v.f32", vf->data, ggml_nbytes(vf));
    read_file(dir, "mask.f16", mask->data, ggml_nbytes(mask));
    for (int i = 0; i < n_kv; ++i) {
        ((int64_t *) idx->data)[i] = i;
        ((int32_t *) ridx->data)[i] = i;
    }
    memset(kc->data, 0xff, ggml_nbytes(kc)); // poison: every byte must be written
    memset(vc->data, 0xff, ggml_nbytes(vc));

    // cache writes, tagged with the clip ratio the way llama_kv_cache::cpy_k/cpy_v do
    struct ggml_tensor * kw = ggml_set_rows(ctx, kc, kf, idx);
    struct ggml_tensor * vw = ggml_set_rows(ctx, vc, vf, idx);
    memcpy(kw->op_params, &clip_k, sizeof(float));
    memcpy(vw->op_params, &clip_v, sizeof(float));

    struct ggml_tensor * k = ggml_permute(ctx, ggml_view_3d(ctx, kw, D, H_kv, n_kv,
            ggml_row_size(kt, D), ggml_row_size(kt, D*H_kv), 0), 0, 2, 1, 3);
    struct ggml_tensor * v = ggml_permute(ctx, ggml_view_3d(ctx, vw, DV, H_kv, n_kv,
            ggml_row_size(vt, DV), ggml_row_size(vt, DV*H_kv), 0), 0, 2, 1, 3);

    struct ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f/sqrtf((float) D), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    if (n_hp > 0) {
        // [D, N_HP, H_KV, 1]: the per-head view the window store gives attention
        struct ggml_tensor * kv = ggml_view_4d(ctx, khp, D, n_hp, H_kv, 1, khp->nb[1], ggml_row_size(GGML_TYPE_F16, D), ggml_nbytes(khp), 0);
        struct ggml_tensor * vv = ggml_view_4d(ctx, vhp, DV, n_hp, H_kv, 1, vhp->nb[1], ggml_row_size(GGML_TYPE_F16, DV), ggml_nbytes(vhp), 0);
        ggml_flash_attn_ext_add_window(out, kv, vv);
    }
    struct ggml_tensor * kdeq = ggml_get_rows(ctx, kw, ridx);

    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_build_forward_expand(gf, kdeq);
    if (ggml_graph_compute_with_ctx(ctx, gf, n_threads) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph compute failed\n");
        return 1;
    }

    write_file(dir, "kc.bin", kc->data, ggml_nbytes(kc));
    write_file(dir, "vc.bin", vc->data, ggml_nbytes(vc));
    write_file(dir, "kdeq.f32", kdeq->data, ggml_nbytes(kdeq));
    write_file(dir, "out.f32", out->data, ggml_nbytes(out));
    ggml_free(ctx);
    return 0;
}
