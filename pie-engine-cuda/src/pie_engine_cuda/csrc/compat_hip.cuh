// Portability layer, HIP side (hiprtc). The kernels are CUDA C; this header maps the few
// CUDA names they use. AMD wavefronts are 64 lanes on CDNA/GCN and 32 on RDNA (wave32); the
// engine passes the size as -DPIE_WARP_SIZE (the compiler's own macro for it is deprecated).
#define PIE_HIP 1
#define PIE_WARP PIE_WARP_SIZE
#define PIE_DEVICE __device__ __forceinline__
#define PIE_KERNEL(name, Args, threads) extern "C" __global__ void __launch_bounds__(threads) name(const Args args)
// HIP's second launch bound counts warps per execution unit, not blocks: only the first is given.
#define PIE_KERNEL_BLOCKS(name, Args, threads, blocks) PIE_KERNEL(name, Args, threads)
#define PIE_OFFSETOF(type, field) __builtin_offsetof(type, field)
// Tensor-core variants use NVIDIA's mma.sync; AMD's MFMA would need kernels of their own.
#define PIE_HAS_MMA 0

extern __shared__ unsigned char pie_dynamic_shared[];
#define PIE_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(pie_dynamic_shared)

PIE_DEVICE float pie_as_float(unsigned bits) { return __uint_as_float(bits); }
PIE_DEVICE unsigned pie_as_uint(float value) { return __float_as_uint(value); }

// Split-K blocks publish partial sums before counting their arrival, and the last reads the others'.
PIE_DEVICE int pie_atomic_add(int* p, int v) { return atomicAdd(p, v); }
PIE_DEVICE void pie_fence() { __threadfence(); }

// HIP's shuffles act on the whole wavefront; the CUDA mask argument has no counterpart.
PIE_DEVICE float pie_shfl_xor(float v, int mask) { return __shfl_xor(v, mask); }
PIE_DEVICE int pie_shfl_xor(int v, int mask) { return __shfl_xor(v, mask); }
PIE_DEVICE float pie_shfl(float v, int lane) { return __shfl(v, lane); }
PIE_DEVICE int pie_shfl(int v, int lane) { return __shfl(v, lane); }

struct pie_f16 { unsigned short bits; };

PIE_DEVICE float pie_f16_to_f32(pie_f16 h) { return static_cast<float>(__builtin_bit_cast(_Float16, h.bits)); }

PIE_DEVICE pie_f16 pie_f32_to_f16(float f) {
  pie_f16 h;
  h.bits = __builtin_bit_cast(unsigned short, static_cast<_Float16>(f));
  return h;
}
