// Runs a Metal compute kernel on the CPU with the semantics the GPU promises, so
// a wrong barrier, a divergent collective or an out-of-bounds access fails the launch.
//
// Threadgroups run one after another. Inside a threadgroup every thread is a fiber
// (ucontext) that runs until it reaches a threadgroup barrier or a simdgroup
// collective (simd_sum, simdgroup_barrier...), then yields to the scheduler. A
// barrier opens when every thread of the threadgroup waits at it; a collective
// completes when every active lane of the simdgroup has called the same one (lanes
// that returned are inactive, as on the GPU). If some threads wait while the others
// have returned, or wait at different places, the launch fails with the reason.
// Segmentation faults (buffers sit against guard pages), arithmetic traps and a
// watchdog alarm end the launch through siglongjmp with a report instead of
// killing the process. Kernels without barriers or collectives can run "plain":
// a direct loop over the threads; a collective reached in that mode is an error.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <csetjmp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

namespace pie_emu {

enum Error : int {
    OK = 0,
    DEADLOCK = 1,
    DIVERGENT_BARRIER = 2,
    MIXED_COLLECTIVES = 3,
    FAULT = 4,
    ARITHMETIC_TRAP = 5,
    TIMEOUT = 6,
    BAD_LAUNCH = 7,
    PARAMS_TOO_SMALL = 8,
    COLLECTIVE_IN_PLAIN_MODE = 9,
    INACTIVE_LANE = 10,
};

enum Op : int { OP_BARRIER = 1, OP_SUM, OP_MAX, OP_MIN, OP_SHUFFLE };

struct U3 {
    unsigned x, y, z;
};

struct Ids {
    U3 thread_position_in_grid;
    U3 thread_position_in_threadgroup;
    U3 threadgroup_position_in_grid;
    U3 threads_per_threadgroup;
    U3 threadgroups_per_grid;
    U3 threads_per_grid;
    unsigned thread_index_in_threadgroup;
    unsigned thread_index_in_simdgroup;
    unsigned simdgroup_index_in_threadgroup;
    unsigned threads_per_simdgroup;
    unsigned simdgroups_per_threadgroup;
};

// Filled by the Python side (ctypes structures of the same layout).
struct Launch {
    uint32_t groups[3];
    uint32_t threads[3];
    uint32_t simd_width;
    uint32_t plain;
    uint64_t seed;
    uint32_t timeout_s;
    uint32_t reserved;
};

struct Report {
    int32_t error;
    uint32_t threadgroup[3];
    uint32_t thread;
    uint32_t reserved;
    uint64_t fault_address;
};

struct Exchange {
    const unsigned char (*values)[64];
    uint64_t active;
    unsigned width;
    unsigned lane;
};

enum State { READY, WAIT_BARRIER, WAIT_SIMD, DONE };

struct Fiber {
    ucontext_t context;
    Ids ids;
    State state;
    int op;
};

struct SimdGroup {
    alignas(16) unsigned char values[2][64][64];
    uint64_t active[2];
    unsigned generation;
};

constexpr unsigned kMaxThreads = 1024;
constexpr size_t kStackBytes = 64 * 1024;

struct Runtime {
    std::vector<Fiber> fibers;
    std::vector<SimdGroup> simdgroups;
    unsigned current = 0;
    bool plain = false;
    ucontext_t scheduler;
    char* stacks = nullptr;
    size_t page = 0;
    const std::function<void(const Ids&)>* body = nullptr;
    Report* report = nullptr;
    sigjmp_buf escape;
    char alternate_stack[64 * 1024];
    uint64_t threadgroup_serial = 0;
    std::vector<std::pair<const void*, uint64_t>> shared_marks;
};

static Runtime runtime;

[[noreturn]] inline void fail(int error) { siglongjmp(runtime.escape, error); }

inline Fiber& current_fiber() { return runtime.fibers[runtime.current]; }

// Called where a threadgroup array is declared: the first thread of each threadgroup to get
// there fills it with 0xFF bytes (NaN as float), so reading memory that no thread of this
// threadgroup wrote, as a missing barrier would, gives poison instead of stale values.
inline void fresh_shared(const void* array, size_t bytes) {
    for (auto& mark : runtime.shared_marks) {
        if (mark.first == array) {
            if (mark.second != runtime.threadgroup_serial) {
                std::memset(const_cast<void*>(array), 0xFF, bytes);
                mark.second = runtime.threadgroup_serial;
            }
            return;
        }
    }
    std::memset(const_cast<void*>(array), 0xFF, bytes);
    runtime.shared_marks.emplace_back(array, runtime.threadgroup_serial);
}

inline void threadgroup_barrier() {
    if (runtime.plain) fail(COLLECTIVE_IN_PLAIN_MODE);
    Fiber& me = current_fiber();
    me.state = WAIT_BARRIER;
    swapcontext(&me.context, &runtime.scheduler);
}

// Post this lane's value, wait for the simdgroup's other active lanes, and see all of theirs.
// Values alternate between two slots, so a lane that races ahead to the next collective
// cannot overwrite what a slower lane has yet to read.
inline Exchange simd_exchange(const void* value, size_t size, int op) {
    if (runtime.plain) fail(COLLECTIVE_IN_PLAIN_MODE);
    Fiber& me = current_fiber();
    unsigned lane = me.ids.thread_index_in_simdgroup;
    SimdGroup& group = runtime.simdgroups[me.ids.simdgroup_index_in_threadgroup];
    unsigned slot = group.generation & 1u;
    if (size) std::memcpy(group.values[slot][lane], value, size);
    me.state = WAIT_SIMD;
    me.op = op;
    swapcontext(&me.context, &runtime.scheduler);
    return Exchange{group.values[slot], group.active[slot], me.ids.threads_per_simdgroup, lane};
}

inline void fiber_entry() {
    Fiber& me = current_fiber();
    (*runtime.body)(me.ids);
    me.state = DONE;  // returning resumes the scheduler through uc_link
}

inline void on_signal(int sig, siginfo_t* info, void*) {
    runtime.report->fault_address = reinterpret_cast<uint64_t>(info->si_addr);
    fail(sig == SIGFPE ? ARITHMETIC_TRAP : sig == SIGALRM ? TIMEOUT : FAULT);
}

inline bool prepare_stacks() {
    if (runtime.stacks) return true;
    runtime.page = size_t(sysconf(_SC_PAGESIZE));
    size_t total = kMaxThreads * kStackBytes;
    void* region = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) return false;
    runtime.stacks = static_cast<char*>(region);
    for (unsigned i = 0; i < kMaxThreads; ++i) {  // a guard page under every stack catches overflows
        mprotect(runtime.stacks + i * kStackBytes, runtime.page, PROT_NONE);
    }
    return true;
}

inline Ids ids_of(const Launch& l, U3 group, unsigned index) {
    Ids id;
    const uint32_t* t = l.threads;
    id.threads_per_threadgroup = U3{t[0], t[1], t[2]};
    id.threadgroups_per_grid = U3{l.groups[0], l.groups[1], l.groups[2]};
    id.threads_per_grid = U3{l.groups[0] * t[0], l.groups[1] * t[1], l.groups[2] * t[2]};
    id.threadgroup_position_in_grid = group;
    U3 local{index % t[0], (index / t[0]) % t[1], index / (t[0] * t[1])};
    id.thread_position_in_threadgroup = local;
    id.thread_position_in_grid = U3{group.x * t[0] + local.x, group.y * t[1] + local.y, group.z * t[2] + local.z};
    id.thread_index_in_threadgroup = index;
    id.threads_per_simdgroup = l.simd_width;
    id.thread_index_in_simdgroup = index % l.simd_width;
    id.simdgroup_index_in_threadgroup = index / l.simd_width;
    unsigned count = t[0] * t[1] * t[2];
    id.simdgroups_per_threadgroup = (count + l.simd_width - 1) / l.simd_width;
    return id;
}

// Let waiting fibers go where the rules allow; returns false when nothing can move.
inline bool release(unsigned count) {
    unsigned waiting_barrier = 0, done = 0, ready = 0;
    for (unsigned i = 0; i < count; ++i) {
        State s = runtime.fibers[i].state;
        waiting_barrier += s == WAIT_BARRIER;
        done += s == DONE;
        ready += s == READY;
    }
    bool moved = false;
    for (unsigned g = 0; g < runtime.simdgroups.size(); ++g) {
        unsigned width = runtime.fibers[0].ids.threads_per_simdgroup;
        unsigned first = g * width, last = std::min(count, first + width);
        uint64_t waiting = 0;
        int op = 0;
        bool all_waiting = true, mixed = false;
        for (unsigned i = first; i < last; ++i) {
            const Fiber& f = runtime.fibers[i];
            if (f.state == DONE) continue;
            if (f.state != WAIT_SIMD) {
                all_waiting = false;
                break;
            }
            if (op && f.op != op) mixed = true;
            op = f.op;
            waiting |= uint64_t(1) << (i - first);
        }
        if (!all_waiting || !waiting) continue;
        if (mixed) {
            runtime.report->thread = first;
            fail(MIXED_COLLECTIVES);
        }
        SimdGroup& group = runtime.simdgroups[g];
        group.active[group.generation & 1u] = waiting;
        group.generation += 1;
        for (unsigned i = first; i < last; ++i)
            if (runtime.fibers[i].state == WAIT_SIMD) runtime.fibers[i].state = READY;
        moved = true;
    }
    if (!moved && ready == 0 && waiting_barrier > 0 && waiting_barrier + done == count) {
        if (done > 0) fail(DIVERGENT_BARRIER);
        for (unsigned i = 0; i < count; ++i) runtime.fibers[i].state = READY;
        moved = true;
    }
    return moved || ready > 0;
}

inline void run_threadgroup(const Launch& l, U3 group, unsigned count, std::mt19937_64* shuffle) {
    runtime.threadgroup_serial += 1;
    runtime.fibers.resize(count);
    runtime.simdgroups.assign((count + l.simd_width - 1) / l.simd_width, SimdGroup());
    for (unsigned i = 0; i < count; ++i) {
        Fiber& f = runtime.fibers[i];
        f.ids = ids_of(l, group, i);
        f.state = READY;
        f.op = 0;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = runtime.stacks + i * kStackBytes + runtime.page;
        f.context.uc_stack.ss_size = kStackBytes - runtime.page;
        f.context.uc_link = &runtime.scheduler;
        makecontext(&f.context, fiber_entry, 0);
    }
    std::vector<unsigned> order(count);
    for (unsigned i = 0; i < count; ++i) order[i] = i;
    for (;;) {
        if (shuffle) std::shuffle(order.begin(), order.end(), *shuffle);
        for (unsigned i : order) {
            if (runtime.fibers[i].state != READY) continue;
            runtime.current = i;
            runtime.report->thread = i;
            swapcontext(&runtime.scheduler, &runtime.fibers[i].context);
        }
        bool finished = std::all_of(runtime.fibers.begin(), runtime.fibers.end(),
                                    [](const Fiber& f) { return f.state == DONE; });
        if (finished) return;
        if (!release(count)) fail(DEADLOCK);
    }
}

inline void run_plain(const Launch& l, U3 group, unsigned count) {
    runtime.threadgroup_serial += 1;
    runtime.fibers.resize(1);
    runtime.current = 0;
    for (unsigned i = 0; i < count; ++i) {
        runtime.fibers[0].ids = ids_of(l, group, i);
        runtime.report->thread = i;
        (*runtime.body)(runtime.fibers[0].ids);
    }
}

inline int params_too_small(Report* report, unsigned index) {
    report->error = PARAMS_TOO_SMALL;
    report->thread = index;
    return PARAMS_TOO_SMALL;
}

// Run the whole grid. Returns 0, or an Error with `report` saying where.
inline int launch(const Launch* l, Report* report, const std::function<void(const Ids&)>& body) {
    std::memset(report, 0, sizeof(Report));
    unsigned count = l->threads[0] * l->threads[1] * l->threads[2];
    bool width_ok = l->simd_width >= 4 && l->simd_width <= 64 && (l->simd_width & (l->simd_width - 1)) == 0;
    if (count == 0 || count > kMaxThreads || !width_ok || !prepare_stacks()) {
        report->error = BAD_LAUNCH;
        return BAD_LAUNCH;
    }
    runtime.body = &body;
    runtime.report = report;
    runtime.plain = l->plain != 0;

    stack_t alternate{};
    alternate.ss_sp = runtime.alternate_stack;
    alternate.ss_size = sizeof(runtime.alternate_stack);
    stack_t previous_stack{};
    sigaltstack(&alternate, &previous_stack);
    struct sigaction action {};
    action.sa_sigaction = on_signal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    const int signals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGALRM};
    struct sigaction previous[4];
    for (int i = 0; i < 4; ++i) sigaction(signals[i], &action, &previous[i]);
    alarm(l->timeout_s);

    std::mt19937_64 generator(l->seed);
    volatile uint32_t gx = 0, gy = 0, gz = 0;
    int error = sigsetjmp(runtime.escape, 1);
    if (error == 0) {
        for (gz = 0; gz < l->groups[2]; gz = gz + 1)
            for (gy = 0; gy < l->groups[1]; gy = gy + 1)
                for (gx = 0; gx < l->groups[0]; gx = gx + 1) {
                    U3 group{gx, gy, gz};
                    if (runtime.plain)
                        run_plain(*l, group, count);
                    else
                        run_threadgroup(*l, group, count, l->seed ? &generator : nullptr);
                }
    }
    alarm(0);
    for (int i = 0; i < 4; ++i) sigaction(signals[i], &previous[i], nullptr);
    sigaltstack(&previous_stack, nullptr);
    report->error = error;
    report->threadgroup[0] = gx;
    report->threadgroup[1] = gy;
    report->threadgroup[2] = gz;
    return error;
}

// Kernel arguments for the position attributes, in the type the kernel declares.
template <class T> struct Position;
template <> struct Position<unsigned> {
    static unsigned from(U3 v) { return v.x; }
};
template <> struct Position<unsigned short> {
    static unsigned short from(U3 v) { return static_cast<unsigned short>(v.x); }
};
template <class T> T position(U3 v) { return Position<T>::from(v); }

}  // namespace pie_emu
