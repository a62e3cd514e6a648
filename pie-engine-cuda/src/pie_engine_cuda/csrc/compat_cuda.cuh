// Portability layer, CUDA side (NVRTC). NVRTC is given no include path, so this file and the
// kernels use no system header: half conversions and tensor-core instructions are inline PTX.
#define PIE_CUDA 1
#define PIE_WARP 32
#define PIE_DEVICE __device__ __forceinline__
#define PIE_KERNEL(name, Args, threads) extern "C" __global__ void __launch_bounds__(threads) name(const Args args)
// A kernel whose registers must leave room for `blocks` resident blocks per multiprocessor.
#define PIE_KERNEL_BLOCKS(name, Args, threads, blocks) \
  extern "C" __global__ void __launch_bounds__(threads, blocks) name(const Args args)
#define PIE_OFFSETOF(type, field) __INTADDR__(&((type*)0)->field)
#if __CUDA_ARCH__ >= 800
#define PIE_HAS_MMA 1
#else
#define PIE_HAS_MMA 0
#endif

extern __shared__ __align__(16) unsigned char pie_dynamic_shared[];
#define PIE_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(pie_dynamic_shared)

PIE_DEVICE float pie_as_float(unsigned bits) { return __uint_as_float(bits); }
PIE_DEVICE unsigned pie_as_uint(float value) { return __float_as_uint(value); }

// Split-K blocks publish partial sums before counting their arrival, and the last reads the others'.
PIE_DEVICE int pie_atomic_add(int* p, int v) { return atomicAdd(p, v); }
PIE_DEVICE void pie_fence() { __threadfence(); }

PIE_DEVICE float pie_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
PIE_DEVICE int pie_shfl_xor(int v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
PIE_DEVICE float pie_shfl(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
PIE_DEVICE int pie_shfl(int v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }

struct pie_f16 { unsigned short bits; };

PIE_DEVICE float pie_f16_to_f32(pie_f16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}

PIE_DEVICE pie_f16 pie_f32_to_f16(float f) {
  pie_f16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}

#if PIE_HAS_MMA
// Round to TF32 (10 mantissa bits), nearest with ties away from zero, as the tensor cores expect.
PIE_DEVICE unsigned pie_to_tf32(float f) {
  unsigned t;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(t) : "f"(f));
  return t;
}

// D += A * B for one warp: A 16x16 (row), B 16x8 (col), f16 or bf16 inputs, f32 accumulators.
// Register layout (PTX ISA, mma.m16n8k16): g = lane / 4, t = lane % 4;
//   a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1]
PIE_DEVICE void pie_mma_f16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

PIE_DEVICE void pie_mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D += A * B with A 16x8 and B 8x8 in TF32 (mma.m16n8k8):
//   a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4]; b[0] = B[t][g], b[1] = B[t+4][g]
PIE_DEVICE void pie_mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
