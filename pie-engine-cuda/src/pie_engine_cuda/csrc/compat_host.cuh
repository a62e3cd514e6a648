// Portability layer, host side: the emulator that runs the CUDA C kernels on the CPU, for tests
// and debugging on machines without a GPU (PIE_CUDA_BACKEND=emulator).
//
// Every CUDA thread is a fiber (ucontext). The fibers of a block run on one OS thread and switch
// only at __syncthreads and at warp collectives (shuffles, mma), so a barrier that not every
// thread reaches is reported as divergence instead of hanging, and runs are deterministic.
// Blocks run one after another, which is why __shared__ can simply mean `static`.
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define PIE_HOST 1
#ifndef PIE_EMU_WARP
#define PIE_EMU_WARP 32
#endif
#define PIE_WARP PIE_EMU_WARP
#define PIE_DEVICE static inline
#define PIE_OFFSETOF(type, field) __builtin_offsetof(type, field)
// The tensor-core emulation follows the 32-lane register layout of mma.sync.
#define PIE_HAS_MMA (PIE_WARP == 32)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
};

namespace pie_emu {

enum class Wait { none, block, warp, done };

struct Fiber {
  ucontext_t context;
  Wait wait;
  dim3 index;
};

struct MmaSlot {
  unsigned a[4];
  unsigned b[2];
};

constexpr size_t kStackBytes = 64 * 1024;

struct State {
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  std::vector<uint64_t> exchange;
  std::vector<MmaSlot> mma;
  std::vector<unsigned char> dynamic_shared;
  ucontext_t scheduler;
  size_t current = 0;
  void (*kernel)(const void*) = nullptr;
  const void* args = nullptr;
  char error[512] = {0};
};

inline State& state() {
  static State instance;
  return instance;
}

inline dim3 grid_dim, block_dim, block_idx;

inline Fiber& self() { return state().fibers[state().current]; }

inline void wait(Wait kind) {
  State& s = state();
  Fiber& fiber = s.fibers[s.current];
  fiber.wait = kind;
  swapcontext(&fiber.context, &s.scheduler);
}

inline void fiber_main() {
  State& s = state();
  s.kernel(s.args);
  s.fibers[s.current].wait = Wait::done;  // returning resumes the scheduler (uc_link)
}

// Runs one block to completion; false (with state().error set) on barrier divergence.
inline bool run_block() {
  State& s = state();
  const size_t n = s.fibers.size();
  for (;;) {
    for (size_t i = 0; i < n; ++i) {
      if (s.fibers[i].wait == Wait::none) {
        s.current = i;
        swapcontext(&s.scheduler, &s.fibers[i].context);
      }
    }
    size_t done = 0, at_block = 0, at_warp = 0;
    for (const Fiber& f : s.fibers) {
      done += f.wait == Wait::done;
      at_block += f.wait == Wait::block;
      at_warp += f.wait == Wait::warp;
    }
    if (done == n) return true;
    bool released = false;
    if (at_block == n) {
      for (Fiber& f : s.fibers) f.wait = Wait::none;
      continue;
    }
    for (size_t lo = 0; lo < n; lo += PIE_WARP) {
      const size_t hi = lo + PIE_WARP < n ? lo + PIE_WARP : n;
      bool whole = true;
      for (size_t i = lo; i < hi; ++i) whole = whole && s.fibers[i].wait == Wait::warp;
      if (whole) {
        for (size_t i = lo; i < hi; ++i) s.fibers[i].wait = Wait::none;
        released = true;
      }
    }
    if (!released) {
      std::snprintf(s.error, sizeof(s.error),
                    "barrier divergence in block (%u,%u,%u): %zu threads exited, %zu wait at __syncthreads, "
                    "%zu at a warp collective",
                    block_idx.x, block_idx.y, block_idx.z, done, at_block, at_warp);
      return false;
    }
  }
}

inline size_t lane() { return state().current % PIE_WARP; }

// Every lane of the warp publishes a value; each then reads the value of `source_lane`.
inline uint64_t exchange(uint64_t mine, int source_lane) {
  State& s = state();
  const size_t me = s.current;
  const size_t base = me - me % PIE_WARP;
  s.exchange[me] = mine;
  wait(Wait::warp);
  const size_t source = base + static_cast<size_t>(source_lane);
  const uint64_t got = source < s.fibers.size() ? s.exchange[source] : mine;
  wait(Wait::warp);
  return got;
}

}  // namespace pie_emu

#define threadIdx (pie_emu::self().index)
#define blockIdx (pie_emu::block_idx)
#define blockDim (pie_emu::block_dim)
#define gridDim (pie_emu::grid_dim)

inline void __syncthreads() { pie_emu::wait(pie_emu::Wait::block); }

#define PIE_KERNEL(name, Args, threads)                                                          \
  static void name##_body(const Args args);                                                      \
  extern "C" void name(const void* packed) { name##_body(*static_cast<const Args*>(packed)); } \
  static void name##_body(const Args args)

#define PIE_KERNEL_BLOCKS(name, Args, threads, blocks) PIE_KERNEL(name, Args, threads)

#define PIE_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(pie_emu::state().dynamic_shared.data())

PIE_DEVICE float pie_as_float(unsigned bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

PIE_DEVICE unsigned pie_as_uint(float value) {
  unsigned bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

// Blocks run one after another here, so the order these give is already there.
PIE_DEVICE int pie_atomic_add(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
PIE_DEVICE void pie_fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

PIE_DEVICE float pie_shfl(float v, int source_lane) {
  return pie_as_float(static_cast<unsigned>(pie_emu::exchange(pie_as_uint(v), source_lane)));
}

PIE_DEVICE int pie_shfl(int v, int source_lane) {
  return static_cast<int>(static_cast<uint32_t>(pie_emu::exchange(static_cast<uint32_t>(v), source_lane)));
}

PIE_DEVICE float pie_shfl_xor(float v, int mask) { return pie_shfl(v, static_cast<int>(pie_emu::lane()) ^ mask); }

PIE_DEVICE int pie_shfl_xor(int v, int mask) { return pie_shfl(v, static_cast<int>(pie_emu::lane()) ^ mask); }

// IEEE half in software, round to nearest even (what cvt.rn.f16.f32 does).
struct pie_f16 { unsigned short bits; };

PIE_DEVICE float pie_f16_to_f32(pie_f16 h) {
  const unsigned sign = (h.bits & 0x8000u) << 16;
  const unsigned exponent = (h.bits >> 10) & 0x1fu;
  const unsigned mantissa = h.bits & 0x3ffu;
  if (exponent == 0x1f) return pie_as_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24, exact
    return sign ? -magnitude : magnitude;
  }
  return pie_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

PIE_DEVICE pie_f16 pie_f32_to_f16(float f) {
  const unsigned x = pie_as_uint(f);
  const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
  const unsigned raw_exponent = (x >> 23) & 0xffu;
  unsigned mantissa = x & 0x7fffffu;
  if (raw_exponent == 0xff) return {static_cast<unsigned short>(sign | 0x7c00u | (mantissa ? 0x200u : 0u))};
  const int exponent = static_cast<int>(raw_exponent) - 127 + 15;
  if (exponent >= 31) return {static_cast<unsigned short>(sign | 0x7c00u)};
  if (exponent <= 0) {
    if (exponent < -10) return {sign};
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    unsigned half = mantissa >> shift;
    const unsigned rest = mantissa & ((1u << shift) - 1);
    const unsigned midpoint = 1u << (shift - 1);
    if (rest > midpoint || (rest == midpoint && (half & 1u))) ++half;
    return {static_cast<unsigned short>(sign | half)};
  }
  unsigned half = sign | (static_cast<unsigned>(exponent) << 10) | (mantissa >> 13);
  const unsigned rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // a carry may round up to infinity
  return {static_cast<unsigned short>(half)};
}

PIE_DEVICE unsigned pie_to_tf32(float f) {
  unsigned u = pie_as_uint(f);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;  // nearest, ties away from zero
  return u & 0xffffe000u;
}

namespace pie_emu {

enum class MmaKind { f16, bf16, tf32 };

inline float half_of(unsigned reg, int high, MmaKind kind) {
  const unsigned short bits = static_cast<unsigned short>(high ? reg >> 16 : reg & 0xffffu);
  if (kind == MmaKind::f16) return pie_f16_to_f32(pie_f16{bits});
  return pie_as_float(static_cast<unsigned>(bits) << 16);
}

// One warp-wide mma.sync: gather every lane's fragments, rebuild A and B from the documented
// register layout, and give each lane its own elements of D.
inline void mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], MmaKind kind) {
  State& s = state();
  const size_t me = s.current;
  const size_t base = me - me % PIE_WARP;
  s.mma[me] = MmaSlot{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  wait(Wait::warp);
  const int k_size = kind == MmaKind::tf32 ? 8 : 16;
  float A[16][16] = {};
  float B[16][8] = {};
  for (int l = 0; l < 32; ++l) {
    const MmaSlot& slot = s.mma[base + l];
    const int g = l / 4, t = l % 4;
    if (kind == MmaKind::tf32) {
      A[g][t] = pie_as_float(slot.a[0]);
      A[g + 8][t] = pie_as_float(slot.a[1]);
      A[g][t + 4] = pie_as_float(slot.a[2]);
      A[g + 8][t + 4] = pie_as_float(slot.a[3]);
      B[t][g] = pie_as_float(slot.b[0]);
      B[t + 4][g] = pie_as_float(slot.b[1]);
    } else {
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = half_of(slot.a[0], h, kind);
        A[g + 8][2 * t + h] = half_of(slot.a[1], h, kind);
        A[g][2 * t + 8 + h] = half_of(slot.a[2], h, kind);
        A[g + 8][2 * t + 8 + h] = half_of(slot.a[3], h, kind);
        B[2 * t + h][g] = half_of(slot.b[0], h, kind);
        B[2 * t + 8 + h][g] = half_of(slot.b[1], h, kind);
      }
    }
  }
  const int g = static_cast<int>(lane()) / 4, t = static_cast<int>(lane()) % 4;
  for (int k = 0; k < k_size; ++k) {
    d[0] += A[g][k] * B[k][2 * t];
    d[1] += A[g][k] * B[k][2 * t + 1];
    d[2] += A[g + 8][k] * B[k][2 * t];
    d[3] += A[g + 8][k] * B[k][2 * t + 1];
  }
  wait(Wait::warp);
}

}  // namespace pie_emu

PIE_DEVICE void pie_mma_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  pie_emu::mma(d, a, b, pie_emu::MmaKind::f16);
}
PIE_DEVICE void pie_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  pie_emu::mma(d, a, b, pie_emu::MmaKind::bf16);
}
PIE_DEVICE void pie_mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  pie_emu::mma(d, a, b, pie_emu::MmaKind::tf32);
}

// Plain CUDA spellings, for generated sources (eta epilogues) that do not use the PIE_ macros.
#define __global__
#define __device__
#define __launch_bounds__(threads)
inline float __uint_as_float(unsigned bits) { return pie_as_float(bits); }
inline unsigned __float_as_uint(float value) { return pie_as_uint(value); }
inline float __int_as_float(int bits) { return pie_as_float(static_cast<unsigned>(bits)); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// Runs a grid; returns 0, or 1 with the reason in pie_emu_error().
extern "C" int pie_emu_launch(void (*kernel)(const void*), unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned shared_bytes, const void* args) {
  using namespace pie_emu;
  State& s = state();
  const size_t n = static_cast<size_t>(bx) * by * bz;
  s.error[0] = 0;
  s.kernel = kernel;
  s.args = args;
  s.fibers.assign(n, Fiber{});
  if (s.stacks.size() < n * kStackBytes) s.stacks.resize(n * kStackBytes);
  s.exchange.assign(n, 0);
  s.mma.assign(n, MmaSlot{});
  s.dynamic_shared.assign(shared_bytes, 0xff);  // all-ones reads back as NaN: uninitialized use shows
  grid_dim = dim3{gx, gy, gz};
  block_dim = dim3{bx, by, bz};
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        block_idx = dim3{x, y, z};
        for (size_t i = 0; i < n; ++i) {
          Fiber& f = s.fibers[i];
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = s.stacks.data() + i * kStackBytes;
          f.context.uc_stack.ss_size = kStackBytes;
          f.context.uc_link = &s.scheduler;
          makecontext(&f.context, fiber_main, 0);
          f.wait = Wait::none;
          f.index = dim3{static_cast<unsigned>(i % bx), static_cast<unsigned>((i / bx) % by),
                         static_cast<unsigned>(i / (static_cast<size_t>(bx) * by))};
        }
        if (!run_block()) return 1;
      }
  return 0;
}

extern "C" const char* pie_emu_error() { return pie_emu::state().error; }
