// oscar2_ops.c: run the real ggml ops on oscar2 caches, for tests/test_oscar2_ops.py (on the CPU,
// and on a GPU machine on CUDA too).
//
//   oscar2_ops KT VT D DV N_KV N_Q H H_KV CLIP_K CLIP_V N_THREADS DIR [N_HP]
//
// Reads DIR/q.f32 [H][N_Q][D], DIR/k.f32 [N_KV][H_KV*D], DIR/v.f32 [N_KV][H_KV*DV] and
// DIR/mask.f16 [N_Q][N_KV (+ N_HP)]; writes the K and V caches into DIR/kc.bin and DIR/vc.bin
// through GGML_OP_SET_ROWS (with the clip ratio, ggml_oscar2_set_clip, as the KV cache does),
// reads them back through GGML_OP_GET_ROWS into DIR/kdeq.f32, and writes the flash
// attention output [N_Q][H][DV] into DIR/out.f32. Everything runs on the backend named by
// $OSCAR_BACKEND (default CPU; e.g. CUDA0). KT/VT are ggml type names (oscar2, oscar2_64,
// f16, ...). The tests compare all of it with the numpy reference.
//
// With N_HP > 0, DIR/khp.f32 and DIR/vhp.f32 [N_HP][H_KV*D] are written into f16 window rows
// (set_rows, like llama.cpp's window store) and given to the attention with
// ggml_flash_attn_ext_add_window; the mask then has N_KV + N_HP columns.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-oscar/oscar2-ops.h"

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

static void * read_file(const char * dir, const char * name, size_t n) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    void * dst = malloc(n);
    FILE * f = fopen(path, "rb");
    if (!f || fread(dst, 1, n, f) != n) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
    fclose(f);
    return dst;
}

static void write_tensor(const char * dir, const char * name, const struct ggml_tensor * t) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    const size_t n = ggml_nbytes(t);
    void * buf = malloc(n);
    ggml_backend_tensor_get(t, buf, 0, n);
    FILE * f = fopen(path, "wb");
    if (!f || fwrite(buf, 1, n, f) != n) { fprintf(stderr, "cannot write %s\n", path); exit(2); }
    fclose(f);
    free(buf);
}

static void set_from_file(struct ggml_tensor * t, const char * dir, const char * name) {
    void * data = read_file(dir, name, ggml_nbytes(t));
    ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
    free(data);
}

int main(int argc, char ** argv) {
    if (argc != 13 && argc != 14) {
        fprintf(stderr, "usage: %s KT VT D DV N_KV N_Q H H_KV CLIP_K CLIP_V N_THREADS DIR [N_HP]\n", argv[0]);
        return 2;
    }
    const enum ggml_type kt = type_by_name(argv[1]);
    const enum ggml_type vt = type_by_name(argv[2]);
    const int D = atoi(argv[3]), DV = atoi(argv[4]), n_kv = atoi(argv[5]), n_q = atoi(argv[6]);
    const int H = atoi(argv[7]), H_kv = atoi(argv[8]);
    const float clip_k = (float) atof(argv[9]), clip_v = (float) atof(argv[10]);
    const int n_threads = atoi(argv[11]);
    const char * dir = argv[12];
    const int n_hp = argc == 14 ? atoi(argv[13]) : 0;

    const char * backend_name = getenv("OSCAR_BACKEND") ? getenv("OSCAR_BACKEND") : "CPU";
    ggml_backend_load_all();
    ggml_backend_t backend = ggml_backend_init_by_name(backend_name, NULL);
    if (!backend) {
        fprintf(stderr, "no backend %s\n", backend_name);
        return 2;
    }
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        void (*set_threads)(ggml_backend_t, int) =
            (void (*)(ggml_backend_t, int)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
        if (set_threads) {
            set_threads(backend, n_threads);
        }
    }

    struct ggml_init_params ip = { (size_t) 256*ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(ip);

    struct ggml_tensor * q    = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, D, n_q, H);
    struct ggml_tensor * kf   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D*H_kv, n_kv);
    struct ggml_tensor * vf   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, DV*H_kv, n_kv);
    struct ggml_tensor * kc   = ggml_new_tensor_2d(ctx, kt, D*H_kv, n_kv);
    struct ggml_tensor * vc   = ggml_new_tensor_2d(ctx, vt, DV*H_kv, n_kv);
    struct ggml_tensor * idx  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_kv);
    struct ggml_tensor * ridx = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_kv);
    struct ggml_tensor * mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv + n_hp, n_q);
    struct ggml_tensor * khf = NULL, * vhf = NULL, * khp = NULL, * vhp = NULL, * hidx = NULL;
    if (n_hp > 0) {
        khf  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, D*H_kv, n_hp);
        vhf  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, DV*H_kv, n_hp);
        khp  = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, D*H_kv, n_hp);
        vhp  = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, DV*H_kv, n_hp);
        hidx = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_hp);
    }

    // cache writes with their clip ratio, as llama_kv_cache::cpy_k/cpy_v make them
    struct ggml_tensor * kw = ggml_set_rows(ctx, kc, kf, idx);
    struct ggml_tensor * vw = ggml_set_rows(ctx, vc, vf, idx);
    ggml_oscar2_set_clip(kw, clip_k);
    ggml_oscar2_set_clip(vw, clip_v);

    struct ggml_tensor * k = ggml_permute(ctx, ggml_view_3d(ctx, kw, D, H_kv, n_kv,
            ggml_row_size(kt, D), ggml_row_size(kt, D*H_kv), 0), 0, 2, 1, 3);
    struct ggml_tensor * v = ggml_permute(ctx, ggml_view_3d(ctx, vw, DV, H_kv, n_kv,
            ggml_row_size(vt, DV), ggml_row_size(vt, DV*H_kv), 0), 0, 2, 1, 3);

    struct ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, mask, 1.0f/sqrtf((float) D), 0.0f, 0.0f);
    ggml_prec_set_acc(out, GGML_PREC_F32);
    if (n_hp > 0) {
        struct ggml_tensor * khw = ggml_set_rows(ctx, khp, khf, hidx);
        struct ggml_tensor * vhw = ggml_set_rows(ctx, vhp, vhf, hidx);
        // [D, N_HP, H_KV, 1]: the per-head view the window store gives attention
        struct ggml_tensor * kv = ggml_view_4d(ctx, khw, D, n_hp, H_kv, 1, khp->nb[1], ggml_row_size(GGML_TYPE_F16, D), ggml_nbytes(khp), 0);
        struct ggml_tensor * vv = ggml_view_4d(ctx, vhw, DV, n_hp, H_kv, 1, vhp->nb[1], ggml_row_size(GGML_TYPE_F16, DV), ggml_nbytes(vhp), 0);
        ggml_flash_attn_ext_add_window(out, kv, vv);
    }
    struct ggml_tensor * kdeq = ggml_get_rows(ctx, kw, ridx);

    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_build_forward_expand(gf, kdeq);

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf) {
        fprintf(stderr, "allocation failed\n");
        return 1;
    }

    set_from_file(q, dir, "q.f32");
    set_from_file(kf, dir, "k.f32");
    set_from_file(vf, dir, "v.f32");
    set_from_file(mask, dir, "mask.f16");
    {
        int64_t * i64 = malloc(sizeof(int64_t)*n_kv);
        int32_t * i32 = malloc(sizeof(int32_t)*n_kv);
        for (int i = 0; i < n_kv; ++i) { i64[i] = i; i32[i] = i; }
        ggml_backend_tensor_set(idx, i64, 0, ggml_nbytes(idx));
        ggml_backend_tensor_set(ridx, i32, 0, ggml_nbytes(ridx));
        free(i64); free(i32);
        // poison the caches: every byte must be written
        ggml_backend_tensor_memset(kc, 0xff, 0, ggml_nbytes(kc));
        ggml_backend_tensor_memset(vc, 0xff, 0, ggml_nbytes(vc));
    }
    if (n_hp > 0) {
        set_from_file(khf, dir, "khp.f32");
        set_from_file(vhf, dir, "vhp.f32");
        int64_t * h = malloc(sizeof(int64_t)*n_hp);
        for (int i = 0; i < n_hp; ++i) h[i] = i;
        ggml_backend_tensor_set(hidx, h, 0, ggml_nbytes(hidx));
        free(h);
    }

    if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "graph compute failed\n");
        return 1;
    }

    write_tensor(dir, "kc.bin", kc);
    write_tensor(dir, "vc.bin", vc);
    write_tensor(dir, "kdeq.f32", kdeq);
    write_tensor(dir, "out.f32", out);

    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(backend);
    return 0;
}
