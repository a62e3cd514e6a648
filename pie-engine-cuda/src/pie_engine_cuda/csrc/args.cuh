// Kernel arguments. Every kernel takes one of these structs by value; the host parses this file
// into ctypes structs (pie_engine_cuda/args.py: fields are pointers, long long, int or float), fills
// one and passes its address, and the compile unit ends with static_asserts of the host's layout.
// Pointers first, then 8-byte integers, then 4-byte fields: no hidden padding.

struct BinaryArgs {
  const float* a;
  const float* b;
  float* out;
  long long n;
};

struct SiluMulArgs {
  const float* x;
  float* out;
  long long n;  // rows * half
  int half;
};

struct SliceArgs {
  const float* x;
  float* out;
  long long n;  // rows * count
  int width;
  int start;
  int count;
};

struct GatherArgs {
  const int* rows;
  const void* table;  // float, pie_f16 or pie_bf16, by kernel
  float* out;
  long long n;  // len(rows) * cols
  int cols;
  int table_rows;
};

struct RmsArgs {
  const float* x;
  const float* weight;
  float* out;
  int rows;
  int cols;
  float eps;
};

struct RopeArgs {
  const float* x;
  const int* positions;
  const float* inv_freq;
  float* out;
  int tokens;
  int heads;
  int head_dim;
};

struct AppendKvArgs {
  float* pool;  // this layer's pages: [pages, 2, page_size, width]
  const float* k;
  const float* v;
  const int* slots;
  int tokens;
  int width;
  int page_size;
};

struct QkvRopeArgs {
  const float* qkv;       // [tokens, q_width + 2 * kv_width]
  const int* positions;   // [tokens]
  const float* inv_freq;  // [head_dim / 2]
  float* q;               // [tokens, q_width]
  float* k;               // [tokens, kv_width]
  float* v;               // [tokens, kv_width]
  int tokens;
  int q_width;
  int kv_width;
  int head_dim;
};

struct ArgmaxArgs {
  const float* x;
  int* out;
  int rows;
  int cols;
};

struct SoftmaxArgs {
  const float* x;
  float* out;
  int rows;
  int cols;
  float temperature;
};

struct TopKArgs {
  const float* x;  // [rows, cols]
  float* values;   // [rows, k], best first
  int* indices;    // [rows, k]
  int rows;
  int cols;
  int k;           // 1..256
  int pad;
};

struct PagesArgs {
  float* pool;         // [layers, num_pages, page_elems]
  float* buffer;       // [layers, count, page_elems]
  const int* page_ids;
  long long page_elems;
  int num_pages;
  int count;
  int first;           // page_ids index of blockIdx.y == 0 (grids are split at 65535)
  int to_pool;         // 1: buffer -> pool, 0: pool -> buffer
};

struct SweepArgs {
  const float* x;  // 16-byte aligned
  float* sink;     // written only if the sum is exactly 12345 (never, over zeros): keeps the loads
  long long count; // float4 groups
};

struct ConvertArgs {
  const float* src;
  void* dst;  // pie_f16 or pie_bf16, by kernel
  long long n;
};

struct GemmArgs {
  const float* x;         // [rows, k]
  const void* w;          // [n, k] as float, pie_f16 or pie_bf16, by kernel
  const float* bias;      // [n] or null
  const float* residual;  // [rows, out_cols] or null
  const float* norm_w;    // [k] or null: x is RMS-normalized (eps below) and scaled by this weight
  float* out;             // [rows, out_cols]
  float* partial;         // tensor cores split along k: a slot per block, [tiles, splits, 64 * 64 + 64]
  int* arrivals;          // tensor cores split along k: a counter per tile, zero between launches
  int rows;
  int n;
  int k;
  int paired;  // 1: out = silu(x W[:n/2].T) * (x W[n/2:].T), out_cols = n/2
  float eps;
};

struct AttnArgs {
  const float* q;             // [tokens, num_heads * head_dim]
  const float* pool;          // this layer's pages: [pages, 2, page_size, kv_heads * head_dim]
  float* out;                 // [tokens, num_heads * head_dim]
  float* partial;             // split-KV partial states [items, num_heads, head_dim + 2]
  const int* qo_indptr;
  const int* page_indices;
  const int* page_indptr;
  const int* last_lens;
  const int* items;           // work items planned on the host, 3 ints each
  const int* item_ptr;        // split-KV: items of token t are item_ptr[t]..item_ptr[t+1]
  int batch;
  int num_heads;
  int kv_heads;
  int head_dim;
  int page_size;
  int block_q;
  int block_k;
  float scale;
  int window;     // keys a query sees at most, its own last; 0: every key up to its own
  float softcap;  // > 0: each score s becomes softcap * tanh(s / softcap)
};
