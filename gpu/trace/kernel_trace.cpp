// kernel_trace.cpp: every kernel, memcpy and memset of a CUDA process with its GPU start and end
// times, through CUPTI's activity API, loaded by the driver as an injection library:
//
//   g++ -O2 -shared -fPIC -I$CUDA/include gpu/trace/kernel_trace.cpp -o kernel_trace.so -L$CUDA/lib64 -lcupti
//   OSCAR_TRACE_OUT=run.trace CUDA_INJECTION64_PATH=$PWD/kernel_trace.so llama-bench ...
//
// Why: the GPU machine has ncu but no nsys. ncu times each kernel alone (replayed, caches
// flushed), so it cannot show the time between kernels, nor time every launch of a long prefill
// within one call. This records the real timeline at the usual clocks, CUDA graphs included
// (one record per graph node). gpu/trace_summary.py reads the output.
//
// Output, one line per record, tab-separated, in the order CUPTI hands the buffers over:
//   K  start_ns  end_ns  stream  graph_id  grid_x*grid_y*grid_z  mangled_name
//   C  start_ns  end_ns  stream  graph_id  copy_kind  bytes        (copy_kind: 1 = HtoD, 2 = DtoH, 8 = DtoD)
//   S  start_ns  end_ns  stream  graph_id  0  bytes                (memset)
//   R  start_ns  end_ns  thread  0  0  api_name                     (with OSCAR_TRACE_API=1: runtime and
//                                                                  driver calls, host time, same clock)
// OSCAR_TRACE_KERNELS=0 records no K lines (with OSCAR_TRACE_API=1: launches timed without the
// per-kernel records' own host cost).
#include <cupti.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace {

FILE *     g_out = nullptr;
std::mutex g_mutex;
constexpr size_t BUFFER_BYTES = 8u << 20;

void CUPTIAPI buffer_requested(uint8_t ** buffer, size_t * size, size_t * max_records) {
    // CUPTI wants 8-byte alignment; aligned_alloc gives more
    *buffer      = static_cast<uint8_t *>(aligned_alloc(64, BUFFER_BYTES));
    *size        = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t * buffer, size_t, size_t valid) {
    std::lock_guard<std::mutex> lock(g_mutex);
    CUpti_Activity * rec = nullptr;
    while (g_out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
            case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
            case CUPTI_ACTIVITY_KIND_KERNEL: {
                const auto * k = reinterpret_cast<const CUpti_ActivityKernel10 *>(rec);
                fprintf(g_out, "K\t%llu\t%llu\t%u\t%u\t%lld\t%s\n", (unsigned long long) k->start, (unsigned long long) k->end,
                        k->streamId, k->graphId, (long long) k->gridX*k->gridY*k->gridZ, k->name ? k->name : "?");
            } break;
            case CUPTI_ACTIVITY_KIND_MEMCPY: {
                const auto * c = reinterpret_cast<const CUpti_ActivityMemcpy6 *>(rec);
                fprintf(g_out, "C\t%llu\t%llu\t%u\t%u\t%u\t%llu\n", (unsigned long long) c->start, (unsigned long long) c->end,
                        c->streamId, c->graphId, (unsigned) c->copyKind, (unsigned long long) c->bytes);
            } break;
            case CUPTI_ACTIVITY_KIND_MEMSET: {
                const auto * s = reinterpret_cast<const CUpti_ActivityMemset4 *>(rec);
                fprintf(g_out, "S\t%llu\t%llu\t%u\t%u\t0\t%llu\n", (unsigned long long) s->start, (unsigned long long) s->end,
                        s->streamId, s->graphId, (unsigned long long) s->bytes);
            } break;
            case CUPTI_ACTIVITY_KIND_RUNTIME:
            case CUPTI_ACTIVITY_KIND_DRIVER: {
                const auto * a = reinterpret_cast<const CUpti_ActivityAPI *>(rec);
                const char * name = nullptr;
                cuptiGetCallbackName(rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                                     a->cbid, &name);
                fprintf(g_out, "R\t%llu\t%llu\t%u\t0\t0\t%s\n", (unsigned long long) a->start, (unsigned long long) a->end,
                        a->threadId, name ? name : "?");
            } break;
            default:
                break;
        }
    }
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
    if (dropped && g_out) {
        fprintf(g_out, "D\t%zu\n", dropped); // the summary refuses a trace with holes
    }
    free(buffer);
}

void finish() {
    cuptiActivityFlushAll(1);
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_out) {
        fclose(g_out);
        g_out = nullptr;
    }
}

bool check(CUptiResult r, const char * what) {
    if (r == CUPTI_SUCCESS) {
        return true;
    }
    const char * msg = nullptr;
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "kernel_trace: %s failed: %s\n", what, msg ? msg : "?");
    return false;
}

} // namespace

// called by the CUDA driver when CUDA_INJECTION64_PATH names this library
extern "C" int InitializeInjection(void) {
    const char * path = getenv("OSCAR_TRACE_OUT");
    if (!path || !(g_out = fopen(path, "w"))) {
        fprintf(stderr, "kernel_trace: set OSCAR_TRACE_OUT to a writable file; not tracing\n");
        return 1;
    }
    bool ok = check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    // the concurrent kind: the plain kernel kind would serialize the kernels it records.
    // OSCAR_TRACE_KERNELS=0 leaves kernels out: recording them adds to each launch's host time,
    // so the API records alone time the launches as they are without the tracer
    const char * kernels = getenv("OSCAR_TRACE_KERNELS");
    if (!kernels || atoi(kernels)) {
        ok = ok && check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
    }
    ok = ok && check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
    ok = ok && check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
    if (ok && getenv("OSCAR_TRACE_API") && atoi(getenv("OSCAR_TRACE_API"))) {
        // the host side too: where the GPU waits, which calls the host was in (or in none: its own work)
        ok = check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime API") &&
             check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "enable driver API");
    }
    if (ok) {
        atexit(finish);
    }
    return 1;
}
